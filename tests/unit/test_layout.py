"""README's layout rule, held: every arrow points down. server/ uses adapters/ through its
`__init__` only, models/ and config/; adapters/ uses models/ and config/; nothing imports
server/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _is_module(name: str) -> bool:
    """Whether `hotlora.x.y` is a module or package of the checkout (`x/y.py`, `x/y/`)."""
    path = ROOT.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported(folder: str) -> list[tuple[str, str]]:
    """(file, module) for every `hotlora.*` module the Python files under `folder` import:
    relative imports resolved, and `from hotlora.x import y` naming `hotlora.x.y` too when `y`
    is a module."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = ["hotlora", *path.relative_to(ROOT).with_suffix("").parts]
        package = parts[:-1]  # a module's package; an `__init__`'s own
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module]
                names += [
                    f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}")
                ]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), n) for n in names if n.startswith("hotlora.")]
    return found


@pytest.mark.parametrize(
    ("folder", "refused"),
    [
        ("adapters", ("hotlora.server",)),
        ("models", ("hotlora.server", "hotlora.adapters")),
        ("config", ("hotlora.server", "hotlora.adapters", "hotlora.models")),
    ],
)
def test_nothing_imports_what_is_above_it(folder: str, refused: tuple[str, ...]):
    assert [(f, m) for f, m in imported(folder) if m.startswith(refused)] == []


def test_the_server_uses_adapters_through_its_init_only():
    inside = [(f, m) for f, m in imported("server") if m.startswith("hotlora.adapters.")]
    assert inside == []
    assert any(m == "hotlora.adapters" for _, m in imported("server"))
