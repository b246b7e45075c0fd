"""The keys file (`--keys`): bearer keys by their SHA-256, each the key of a tenant with a scope.

A TOML file of `[[key]]` tables (see server/OPERATING.md, "Tenants"). `KeyRing` holds the keys
in use: it reads the file at start (a bad file stops the start), again when it changes (checked
at most once a second, as requests arrive) and on `reload()` (SIGHUP); a bad file then is
refused with one log line and the keys already read stay in use. `--api-key` and
`--admin-api-key` are two more keys with every right. Keys are looked up by their hash, in
constant time, and neither a key nor a hash is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hotlora.config.log_text import printable
from hotlora.server.http.tenants import Role, Tenant

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

log = logging.getLogger("hotlora")

CHECK_EVERY_S = 1.0  # how stale the keys may be after the file changes
SETTLED_NS = 50_000_000  # a file changed this recently (ns) may still be being written
KEY_PREFIX = "hl-"  # what `new_key` keys start with, so they are recognisable in a config
_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"  # a tenant's name goes into log lines and labels
_GLOB_PATTERN = r"^[A-Za-z0-9._\-*?\[\]!]{1,64}$"  # an adapter id, or a glob of ids


class KeysFileError(ValueError):
    """The keys file cannot be used; the message is one line naming the file and the problem."""


class KeyEntry(BaseModel):
    """One `[[key]]` table of the keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME_PATTERN, description="The tenant, as logs and metrics show it.")
    sha256: str = Field(
        pattern=r"^[0-9a-fA-F]{64}$", description="The SHA-256 of the bearer key, in hex."
    )
    role: Role = "user"
    adapters: list[str] = Field(default_factory=list, description="Ids or globs it may run.")
    base: bool = Field(default=True, description="Whether it may run the base model alone.")
    mount_prefix: str | None = Field(default=None, min_length=1, max_length=64)
    mount_dir: str | None = Field(default=None, min_length=1)
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_streams: int | None = Field(default=None, gt=0)
    max_pinned: int | None = Field(
        default=None, ge=0, description="tenant-admin: its ids pinned at once, at most."
    )
    weight: float = Field(default=1.0, gt=0, le=1000, description="Its share of the batch.")

    @field_validator("adapters")
    @classmethod
    def _globs(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not re.fullmatch(_GLOB_PATTERN, pattern):
                raise ValueError(
                    f"{pattern!r} is not an adapter id or glob (letters, digits, '.', '_', '-', "
                    "and '*', '?', '[...]')"
                )
        return value

    @field_validator("mount_dir")
    @classmethod
    def _relative_dir(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or "\\" in value:
            raise ValueError(
                f"{value!r} must be a folder relative to --adapter-root, without '..' (e.g. 'acme')"
            )
        return value

    @model_validator(mode="after")
    def _mount_rights(self) -> KeyEntry:
        mounts = self.mount_prefix is not None or self.mount_dir is not None
        if self.role == "tenant-admin" and (self.mount_prefix is None or self.mount_dir is None):
            raise ValueError("a tenant-admin key needs both mount_prefix and mount_dir")
        if self.role != "tenant-admin" and (mounts or self.max_pinned is not None):
            raise ValueError(
                "mount_prefix, mount_dir and max_pinned are for role 'tenant-admin', not "
                f"{self.role!r}"
            )
        return self

    def tenant(self) -> Tenant:
        return Tenant(
            name=self.name,
            weight=self.weight,
            role=self.role,
            adapters=tuple(self.adapters),
            base=self.base,
            mount_prefix=self.mount_prefix,
            mount_dir=self.mount_dir,
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            max_streams=self.max_streams,
            max_pinned=self.max_pinned,
        )


class KeysFile(BaseModel):
    """The whole file: its `[[key]]` tables."""

    model_config = ConfigDict(extra="forbid")

    key: list[KeyEntry] = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct(self) -> KeysFile:
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.key):
            digest = entry.sha256.lower()
            if digest in seen:
                raise ValueError(f"key[{index}] has the same sha256 as key[{seen[digest]}]")
            seen[digest] = index
        return self


@dataclass(frozen=True)
class Key:
    """A key as the ring holds it: its hash (lower-case hex) and whose it is."""

    digest: str
    tenant: Tenant


def key_digest(key: str) -> str:
    """The SHA-256 of a bearer key, in lower-case hex: what the keys file holds."""
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys(path: Path) -> list[Key]:
    """The keys `path` holds; `KeysFileError` (one line, no key or hash in it) when it cannot
    be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"keys file {path}: cannot be read: {exc}") from None
    if not text.strip():
        # What a file being written holds between its truncation and its text.
        raise KeysFileError(
            f"keys file {path}: is empty (a comment alone says it means no keys: '# none')"
        )
    return parse_keys(text, str(path))


def parse_keys(text: str, where: str) -> list[Key]:
    """The keys of a keys file's `text`; `where` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"keys file {where}: not TOML: {exc}") from None
    try:
        parsed = KeysFile.model_validate(data)
    except ValidationError as exc:
        raise KeysFileError(f"keys file {where}: {_problems(exc)}") from None
    return [Key(entry.sha256.lower(), entry.tenant()) for entry in parsed.key]


def _problems(exc: ValidationError) -> str:
    """Each problem's place and message; never the value (it may be a hash)."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        place = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]
        )
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(f"{place.lstrip('.') or 'file'}: {message}")
    return "; ".join(problems)


def flag_keys(api_key: str | None, admin_api_key: str | None) -> list[Key]:
    """`--api-key` and `--admin-api-key` as keys with every right: the API key administers too
    unless an admin key is set, as it always has."""
    keys = []
    if admin_api_key is not None:
        keys.append(Key(key_digest(admin_api_key), Tenant(name="admin", role="admin")))
    if api_key is not None:
        role: Role = "user" if admin_api_key is not None else "admin"
        keys.append(Key(key_digest(api_key), Tenant(name="api-key", role=role)))
    return keys


@dataclass
class _Stamp:
    """What the file looked like when it was last read: changed means read again."""

    mtime_ns: int = -1
    size: int = -1
    inode: int = -1

    @classmethod
    def of(cls, path: Path) -> _Stamp:
        try:
            stat = path.stat()
        except OSError:
            return cls()
        return cls(stat.st_mtime_ns, stat.st_size, stat.st_ino)


@dataclass
class KeyRing:
    """The keys in use: the flags' and the keys file's, read again when the file changes."""

    path: Path | None
    flags: Sequence[Key] = ()
    check_every: float = CHECK_EVERY_S
    clock: Callable[[], float] = time.monotonic
    _keys: tuple[Key, ...] = field(default=(), init=False)
    _stamp: _Stamp = field(default_factory=_Stamp, init=False)
    _checked: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        file_keys: list[Key] = []
        if self.path is not None:
            self._stamp = _Stamp.of(self.path)
            file_keys = read_keys(self.path)  # a bad file at start stops the start
            log.info("keys file %s: %s", printable(str(self.path)), _counted(file_keys))
        self._keys = (*self.flags, *file_keys)
        self._checked = self.clock()

    @property
    def tenants(self) -> list[Tenant]:
        """Every key's tenant, in the file's order after the flags'."""
        return [key.tenant for key in self._keys]

    def lookup(self, key: str) -> Tenant | None:
        """The tenant whose key `key` is, or None. Compares the hash with every key's, each in
        constant time, so the time taken says nothing of which key came near."""
        self.check()
        digest = key_digest(key).encode()
        found: Tenant | None = None
        for candidate in self._keys:
            if hmac.compare_digest(digest, candidate.digest.encode()) and found is None:
                found = candidate.tenant
        return found

    def check(self) -> None:
        """Read the file again if it changed, at most once every `check_every` seconds."""
        if self.path is None or self.clock() - self._checked < self.check_every:
            return
        self._checked = self.clock()
        if _Stamp.of(self.path) != self._stamp:
            self.reload(settled=True)

    def reload(self, *, settled: bool = False) -> bool:
        """Read the file again (SIGHUP, or it changed); whether its keys are now the ones in use.
        A file that cannot be used is refused with one log line, and the old keys stay.

        `settled`: only a file unchanged for a moment, since one changed just now may be half
        written (an editor that truncates first); it is read at a later check then.
        """
        if self.path is None:
            return False
        with self._lock:
            stamp = _Stamp.of(self.path)
            # (A time ahead of the clock, as a copy may keep, counts as settled.)
            if settled and 0 <= time.time_ns() - stamp.mtime_ns < SETTLED_NS:
                return False
            try:
                file_keys = read_keys(self.path)
            except KeysFileError as exc:
                self._stamp = stamp  # a bad file is reported once, not at every check
                log.error(
                    "%s; keeping the %d keys read before", printable(str(exc)), len(self._keys)
                )
                return False
            if _Stamp.of(self.path) != stamp:
                return False  # written to while read: read again at the next check
            self._stamp = stamp
            self._keys = (*self.flags, *file_keys)
        log.info("keys file %s read again: %s", printable(str(self.path)), _counted(file_keys))
        return True


def _counted(keys: list[Key]) -> str:
    tenants = len({key.tenant.name for key in keys})
    return f"{len(keys)} key{'' if len(keys) == 1 else 's'} of {tenants} tenant(s)"


# `hotlora keys add`.


def new_key() -> str:
    """A new random bearer key: 256 bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def add_key(path: Path, entry: dict[str, Any]) -> str:
    """Append a `[[key]]` table for a new key to `path` (made if missing), with `entry`'s fields
    and the new key's hash; return the key. Nothing is written unless the whole file, the new
    table included, reads as a keys file."""
    key = new_key()
    fields = {**entry, "sha256": key_digest(key)}
    try:
        KeyEntry.model_validate(fields)
    except ValidationError as exc:
        raise KeysFileError(f"key {entry.get('name')!r}: {_problems(exc)}") from None
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    text = (old + ("\n" if old and not old.endswith("\n") else "") + _table(fields)).lstrip("\n")
    parse_keys(text, str(path))
    if not path.parent.is_dir():
        raise KeysFileError(f"{path}: its folder {path.parent} does not exist")
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.chmod(0o600)
    os.replace(temporary, path)
    return key


def _table(fields: dict[str, Any]) -> str:
    lines = ["", "[[key]]"]
    for name, value in fields.items():
        if value is None:
            continue
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string
