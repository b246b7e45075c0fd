"""The adapter root's listing: what it tells of the directories on disk."""

from __future__ import annotations

from pathlib import Path

from hotlora.adapters.adapter_config import CONFIG_FILE
from hotlora.adapters.residency import Evicted
from hotlora.adapters.root_listing import list_root


def _adapter_dir(directory: Path, weights: Path | None = None) -> None:
    directory.mkdir(parents=True)
    (directory / CONFIG_FILE).write_text("{}")
    if weights is None:
        (directory / "adapters.safetensors").write_bytes(b"x" * 123)
    else:
        (directory / "adapters.safetensors").symlink_to(weights)


def test_a_weight_file_linking_outside_the_root_has_no_size(tmp_path: Path):
    """The size of a file a mount on first use would refuse to read (one outside the adapter's
    own directory) is not told."""
    outside = tmp_path / "secret"
    outside.write_bytes(b"s" * 4567)
    root = tmp_path / "root"
    _adapter_dir(root / "plain")
    _adapter_dir(root / "leak", weights=outside)
    _adapter_dir(root / "inside", weights=root / "plain" / "adapters.safetensors")
    sizes = {entry.id: entry.size_bytes for entry in list_root(root, (), (), skip="base")}
    assert sizes == {"plain": 123, "leak": None, "inside": None}  # as a first-use mount reads


def test_a_tenants_folder_lists_what_no_mount_named_and_hides_other_ids(tmp_path: Path):
    """Given a tenant's folder: its directories no mount was made from, with no id; one
    mounted under an id the tenant may not see is neither named nor listed as on disk."""
    root = tmp_path / "root"
    for name in ("a", "b", "c"):
        _adapter_dir(root / "acme" / name)
    _adapter_dir(root / "acme-top")
    evicted = [
        Evicted("acme-a", str((root / "acme" / "a").resolve()), "rev", 456, 123, False, 0),
        Evicted("globex-b", str((root / "acme" / "b").resolve()), "rev", 456, 123, False, 0),
    ]
    listed = list_root(
        root,
        (),
        evicted,
        skip="base",
        folder=(root / "acme").resolve(),
        shown=lambda adapter_id: adapter_id.startswith("acme-"),
    )
    assert [(e.id, Path(e.path).name, e.state) for e in listed] == [
        ("acme-a", "a", "evicted"),
        ("acme-top", "acme-top", "on disk"),
        (None, "c", "on disk"),
    ]
