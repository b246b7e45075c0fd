"""The docs' tables of request fields and routes say what the code does: each field's status in
server/API.md's table of vLLM's and llama.cpp's fields is the one `field_support` gives it, every
field the code knows is documented there, and every route the app serves is in the README's
table of endpoints."""

from __future__ import annotations

import re
from pathlib import Path

from hotlora.config.settings import Settings
from hotlora.server.api.field_support import HONOURED, METADATA, REFUSED
from hotlora.server.app import create_app

ROOT = Path(__file__).parents[2]
API = (ROOT / "server" / "API.md").read_text()
README = (ROOT / "README.md").read_text()


def _table(text: str, after: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the first table after the heading `after`."""
    section = text.split(after, 1)[1]
    rows: list[tuple[str, str]] = []
    for line in section.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            if not set(cells[0]) <= {"-", "|"}:
                rows.append((cells[0], cells[1]))
        elif rows:
            break
    return rows[1:]  # past the header


def _field_names(cell: str) -> list[str]:
    """The field each comma-separated item of a cell names: its first backticked word
    (`guided_decoding_backend` other than `guidance` names the first)."""
    names = []
    for item in re.split(r",\s*", cell):
        found = re.search(r"`([a-z_]+\*?)", item)
        if found:
            names.append(found.group(1))
    return names


def _documented(name: str, names: set[str]) -> bool:
    return name in names or any(n.endswith("*") and name.startswith(n[:-1]) for n in names)


def test_each_fields_status_in_the_table_is_the_codes():
    rows = _table(API, "## Fields from vLLM and llama.cpp")
    assert len(rows) > 20
    in_table: set[str] = set()
    for first, status in rows:
        names = _field_names(first)
        assert names, first
        in_table.update(names)
        for name in names:
            if name.endswith("*"):
                assert any(n.startswith(name[:-1]) for n in REFUSED), name
            elif status.startswith("400"):
                assert name in REFUSED, f"server/API.md refuses {name!r}; the code does not"
            else:
                assert name in HONOURED or name in METADATA, (
                    f"server/API.md says {name!r} works; the code does not list it"
                )
    missing = [name for name in REFUSED if not _documented(name, in_table)]
    assert not missing, f"refused fields server/API.md's table leaves out: {missing}"
    missing = [name for name in METADATA if name not in in_table]
    assert not missing, f"accepted fields server/API.md's table leaves out: {missing}"


def test_every_field_the_code_honours_is_named_in_the_api_doc():
    named = set(re.findall(r"`([a-z_]+)", API))
    missing = [name for name in HONOURED if name not in named]
    assert not missing, f"honoured fields server/API.md never names: {missing}"


def _listed_routes() -> set[tuple[str, str]]:
    """(method, path) of each route the table of endpoints names, path parameters as `{}`;
    `GET /v1/adapters[/{id}]` names both paths."""
    listed = set()
    for first, _ in _table(README, "## Endpoints"):
        for method, path in re.findall(r"`([A-Z]+) (/[^`\s]*)`", first):
            path = re.sub(r"\{\w+\}", "{}", path)
            for spelled in (re.sub(r"\[.*?\]", "", path), path.replace("[", "").replace("]", "")):
                listed.add((method, spelled))
    return listed


def test_every_route_is_in_the_table_of_endpoints(tmp_path: Path):
    listed = _listed_routes()
    app = create_app(Settings(home=tmp_path, model=tmp_path / "none"))
    paths = app.openapi()["paths"]
    assert len(paths) > 10
    for path, methods in paths.items():
        for method in methods:
            route = (method.upper(), re.sub(r"\{\w+\}", "{}", path))
            assert route in listed, f"{route} is not in the README's table of endpoints"
