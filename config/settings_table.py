"""The README's settings table, made from `Settings`: `python -m hotlora.config.settings_table`."""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo

from hotlora.config.settings import Settings
from hotlora.config.sources import env_name, flag_name, metavar

HEADER = "| setting | flag | environment | default | |"


def settings_table() -> str:
    """One row per setting: file key, flag, variable, default, description."""
    rows = [HEADER, "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        flag = flag_name(Settings, name)
        if field.annotation is bool:
            flag = f"{flag}`, `--no-{flag[2:]}"
        elif shown := metavar(field):
            flag = f"{flag} {shown}"
        description = (field.description or "").replace("|", "\\|")
        cells = [f"`{name}`", f"`{flag}`", f"`{env_name(Settings, name)}`", _default(name, field)]
        rows.append(f"| {' | '.join(cells)} | {description} |")
    return "\n".join(rows)


def _default(name: str, field: FieldInfo) -> str:
    value: Any = field.get_default(call_default_factory=True)
    if value is None or value == {} or value == "":
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and value and name.endswith("_bytes"):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"`{value}` ({value // size} {unit})"
    return f"`{value}`"


if __name__ == "__main__":
    print(settings_table())
