"""The keys file: its spelling, its errors (never a hash in them), lookups and scopes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hotlora.server.http.keys_file import (
    KeyRing,
    KeysFileError,
    add_key,
    flag_keys,
    key_digest,
    parse_keys,
)
from hotlora.server.http.tenants import Tenant

SPEC_EXAMPLE = f"""
[[key]]
name = "acme"                      # the tenant, as logs and metrics show it
sha256 = "{key_digest("acme-key")}"  # of the bearer key
role = "tenant-admin"              # user | tenant-admin | admin
adapters = ["acme-*"]              # ids or globs this key may run
base = true                        # may it run the base model alone
mount_prefix = "acme-"             # tenant-admin: ids it may mount/replace/unmount
mount_dir = "acme"                 # tenant-admin: folder under --adapter-root it mounts from
requests_per_minute = 600          # optional limits
tokens_per_minute = 200000
max_streams = 32
weight = 2.5
"""


def test_the_documented_spelling_reads():
    (key,) = parse_keys(SPEC_EXAMPLE, "keys.toml")
    assert key.digest == key_digest("acme-key")
    assert key.tenant == Tenant(
        name="acme",
        weight=2.5,
        role="tenant-admin",
        adapters=("acme-*",),
        base=True,
        mount_prefix="acme-",
        mount_dir="acme",
        requests_per_minute=600,
        tokens_per_minute=200000,
        max_streams=32,
    )


def test_scopes_and_globs():
    user = Tenant("acme", role="user", adapters=("acme-*", "shared"), base=False)
    assert user.may_use("acme-sft") and user.may_use("shared") and not user.may_use("sharedx")
    assert not user.may_use("globex-sft") and not user.may_use_base
    assert not user.may_mount("acme-sft") and not user.may_administer
    admin = Tenant("acme", role="tenant-admin", adapters=("acme-*",), mount_prefix="acme-")
    assert admin.may_mount("acme-new") and not admin.may_mount("globex-new")
    assert admin.may_administer and not admin.is_admin
    everything = Tenant("ops", role="admin", adapters=(), base=False)
    assert everything.may_use("anything") and everything.may_use_base
    assert everything.may_mount("anything")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[[key]]\nname = "a b"\nsha256 = "' + "0" * 64 + '"', "key[0].name: String should match"),
        ('[[key]]\nsha256 = "' + "0" * 64 + '"', "key[0].name: Field required"),
        ('[[key]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nadapters = ["a b"]', "key[0].adapters"),
        ('[[key]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nweight = 0', "key[0].weight"),
        ('[keys]\nname = "a"', "keys: Extra inputs are not permitted"),
    ],
)
def test_problems_are_one_line_naming_the_place(text: str, problem: str):
    with pytest.raises(KeysFileError) as refused:
        parse_keys(text, "keys.toml")
    message = str(refused.value)
    assert message.startswith("keys file keys.toml: ") and problem in message
    assert "\n" not in message and "0" * 64 not in message


def test_lookup_flags_and_reads(tmp_path: Path):
    path = tmp_path / "keys.toml"
    path.write_text(SPEC_EXAMPLE)
    ring = KeyRing(path, flag_keys("user-key", "admin-key"), check_every=3600)
    assert ring.lookup("acme-key") is not None and ring.lookup("acme-key").name == "acme"
    user, admin = ring.lookup("user-key"), ring.lookup("admin-key")
    assert user is not None and (user.name, user.role) == ("api-key", "user")
    assert admin is not None and (admin.name, admin.role) == ("admin", "admin")
    assert ring.lookup("acme-key ") is None and ring.lookup("") is None
    only_api = KeyRing(None, flag_keys("user-key", None))
    assert only_api.lookup("user-key").role == "admin"  # administers too, as it always has


def test_add_key_appends_a_table_that_reads(tmp_path: Path):
    path = tmp_path / "keys.toml"
    path.write_text("# the tenants\n")
    first = add_key(path, {"name": "acme", "adapters": ["acme-*"], "max_streams": 4})
    second = add_key(path, {"name": "ops", "role": "admin"})
    assert first != second and first.startswith("hl-")
    text = path.read_text()
    assert text.startswith("# the tenants\n") and first not in text and second not in text
    keys = parse_keys(text, "keys.toml")
    assert [(k.tenant.name, k.digest) for k in keys] == [
        ("acme", key_digest(first)),
        ("ops", key_digest(second)),
    ]
    assert keys[0].tenant.max_streams == 4 and keys[0].tenant.adapters == ("acme-*",)
    with pytest.raises(KeysFileError, match="mount_prefix, mount_dir and max_pinned are for role"):
        add_key(path, {"name": "x", "mount_prefix": "x-"})
    assert path.read_text() == text


def test_a_changed_file_is_read_once_settled(tmp_path: Path):
    path = tmp_path / "keys.toml"
    path.write_text(SPEC_EXAMPLE)
    ring = KeyRing(path, check_every=0.0)
    path.write_text(SPEC_EXAMPLE + f'[[key]]\nname = "new"\nsha256 = "{key_digest("new")}"\n')
    assert ring.reload(settled=True) is False  # changed a moment ago: maybe half written
    past = time.time_ns() - 10**9
    os.utime(path, ns=(past, past))
    assert ring.lookup("new") is not None
    future = time.time_ns() + 3600 * 10**9  # a copy that kept a time ahead of this clock
    path.write_text(SPEC_EXAMPLE)
    os.utime(path, ns=(future, future))
    assert ring.lookup("new") is None
