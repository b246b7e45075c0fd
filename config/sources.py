"""Where settings come from (flags, `HOTLORA_*` variables, a TOML file), named for error lines.

pydantic-settings reads every source; this module adds the config file named by a setting,
the names a setting goes by in each source (a renamed one's old names too, with a warning), and
the one line that says which value is bad and where it came from.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from annotated_types import Ge, Gt, Le, Lt
from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
    TomlConfigSettingsSource,
)

from hotlora.config.errors import HotloraError

if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError
else:
    from tomli import TOMLDecodeError

S = TypeVar("S", bound=BaseSettings)

log = logging.getLogger("hotlora.config")

# The setting that names the config file; the file itself cannot set it.
CONFIG = "config"


class InvalidSetting(HotloraError):
    """A setting's value, or the config file, cannot be used; the message is one line that
    names the setting and where its value came from."""


@dataclass(frozen=True)
class Metavar:
    """How help and error lines show a setting's value where its type would not say
    (`Annotated[dict[str, str], Metavar("NAME=PATH")]`)."""

    text: str


def flag_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The `hotlora serve` flag of a setting: its `cli_shortcuts` alias, else `--kebab-name`."""
    kebab = field.replace("_", "-")
    alias = (settings_cls.model_config.get("cli_shortcuts") or {}).get(kebab)
    if isinstance(alias, list):
        alias = alias[0]
    return f"--{alias or kebab}"


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    """The environment variable of a setting: `HOTLORA_` and its name in capitals."""
    return f"{settings_cls.model_config.get('env_prefix', '')}{field}".upper()


def metavar(field: FieldInfo) -> str | None:
    """The field's `Metavar`, if it has one."""
    return next((m.text for m in field.metadata if isinstance(m, Metavar)), None)


def old_names(settings_cls: type[BaseSettings]) -> dict[str, str]:
    """The old names of renamed settings, each to the setting it names now: the choices of a
    field's `validation_alias` other than its own name."""
    renamed: dict[str, str] = {}
    for name, field in settings_cls.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            for choice in field.validation_alias.choices:
                if isinstance(choice, str) and choice != name:
                    renamed[choice] = name
    return renamed


def old_flags(settings_cls: type[BaseSettings]) -> dict[str, str]:
    """`--old-name` to old name, for each renamed setting: `hotlora serve` takes these flags
    (with a destination of the old name, so `load_settings` can tell) and hides them."""
    return {f"--{old.replace('_', '-')}": old for old in old_names(settings_cls)}


# What the sources noted in this process (renamed settings given under an old name, variables
# that look misspelt): the warning about each, and the ones already logged. `log_setting_notes`
# logs them once logging is set up.
_setting_notes: dict[str, str] = {}
_logged_notes: set[str] = set()


def _note_old_name(setting: str, used: str, current: str) -> None:
    _setting_notes.setdefault(setting, f"{used} is the old name of {current} (it still works)")


def log_setting_notes() -> None:
    """Log a WARNING for each renamed setting given under its old name and each `HOTLORA_*`
    variable that is no setting but nearly names one, once per process."""
    for key, warning in _setting_notes.items():
        if key not in _logged_notes:
            _logged_notes.add(key)
            log.warning(warning)


class Variables(EnvSettingsSource):
    """The `HOTLORA_*` variables; a renamed setting's old variable works, and is noted for
    `log_setting_notes`."""

    def __call__(self) -> dict[str, Any]:
        present = {name.lower() for name in self.env_vars}
        renamed = old_names(self.settings_cls)
        for old, setting in renamed.items():
            if env_name(self.settings_cls, old).lower() in present:
                used, current = (env_name(self.settings_cls, n) for n in (old, setting))
                _note_old_name(setting, used, current)
        self._note_misspelt(present, [*self.settings_cls.model_fields, *renamed])
        return super().__call__()

    def _note_misspelt(self, present: set[str], names: list[str]) -> None:
        """A `HOTLORA_*` variable that is no setting but nearly names one (HOTLORA_MAX_BTACH)
        has no effect: noted, as a TOML key would be refused. Others of the prefix (a
        container's own) pass unremarked."""
        prefix = self.env_prefix.lower()
        for variable in sorted(present):
            name = variable.removeprefix(prefix)
            if not variable.startswith(prefix) or name in names:
                continue
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
            if close:
                _setting_notes.setdefault(
                    variable,
                    f"{variable.upper()} is not a setting and has no effect (did you mean "
                    f"{env_name(self.settings_cls, close[0])}?)",
                )


class ConfigFile(PydanticBaseSettingsSource):
    """The TOML file named by the `config` setting of a higher source (a flag or the
    environment); its keys are the settings' names, and a key that is none of them is an
    error, as is a file that is not there."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get(CONFIG)
        return read_config_file(self.settings_cls, Path(path)) if path else {}


def read_config_file(settings_cls: type[BaseSettings], path: Path) -> dict[str, Any]:
    """The settings in a TOML file, or InvalidSetting naming the file and the key at fault."""
    if not path.expanduser().is_file():
        missing = "not a file" if path.expanduser().exists() else "no such file"
        raise InvalidSetting(f"{path}: {missing}")
    try:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=path.expanduser())
    except TOMLDecodeError as exc:
        raise InvalidSetting(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise InvalidSetting(f"{path}: {exc.strerror or exc}") from None
    known = [name for name in settings_cls.model_fields if name != CONFIG]
    renamed = old_names(settings_cls)
    for key in toml.toml_data:
        if key == CONFIG:
            raise InvalidSetting(f"{path}: {key}: a config file cannot name another")
        if key in renamed:
            _note_old_name(renamed[key], f"{path}: {key}", renamed[key])
        elif key not in known:
            close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise InvalidSetting(f"{path}: {key}: unknown setting{hint}")
    return toml()


def load_settings(
    settings_cls: type[S],
    cli: CliSettingsSource[Any] | None = None,
    parsed_args: Any = None,
) -> S:
    """Settings from every source (flags from `parsed_args` through `cli`, then the
    environment, then the config file), or InvalidSetting with one line for the first problem."""
    flags: Mapping[str, Any] = {}
    try:
        if cli is not None:
            _note_old_flags(settings_cls, parsed_args)
            _refuse_repeated_names(settings_cls, parsed_args)
            cli = cli(parsed_args=parsed_args)
            flags = cli()
        return settings_cls(_cli_settings_source=cli)
    except SettingsError as exc:
        raise _unreadable(settings_cls, exc, parsed_args) from None
    except ValidationError as exc:
        raise invalid_setting(settings_cls, exc, flags) from None


def _refuse_repeated_names(settings_cls: type[BaseSettings], parsed_args: Any) -> None:
    """A mapping's flag given twice with one name (`--adapter a=x --adapter a=y`) is refused:
    merged, the last would silently drop the first."""
    for field, info in settings_cls.model_fields.items():
        given = getattr(parsed_args, field, None)
        if metavar(info) is None or not isinstance(given, list):
            continue
        seen: dict[str, str] = {}
        for pair in given:
            if not isinstance(pair, str) or "=" not in pair or pair.lstrip().startswith("{"):
                continue  # JSON objects and malformed pairs: the parser's to judge
            name = pair.partition("=")[0]
            if name in seen:
                raise InvalidSetting(
                    f"{flag_name(settings_cls, field)}: {name!r} given twice "
                    f"({seen[name]} and {pair})"
                )
            seen[name] = pair


def _note_old_flags(settings_cls: type[BaseSettings], parsed_args: Any) -> None:
    renamed = old_names(settings_cls)
    for flag, old in old_flags(settings_cls).items():
        value = getattr(parsed_args, old, None)
        if value is not None:
            current = flag_name(settings_cls, renamed[old])
            if value is False:  # the --no- form of a true-or-false setting
                flag, current = f"--no-{flag[2:]}", f"--no-{current[2:]}"
            _note_old_name(renamed[old], flag, current)


def _unreadable(
    settings_cls: type[BaseSettings], exc: SettingsError, parsed_args: Any
) -> InvalidSetting:
    """A value pydantic-settings could not decode (a flag's pairs, a variable's JSON)."""
    # pydantic-settings names the field in its message, and nowhere else.
    found = re.search(r'field "(\w+)" from source "(\w+)"|encountered for (\w+):', str(exc))
    if found is None:
        return InvalidSetting(str(exc))
    field = found.group(1) or found.group(3)
    info = settings_cls.model_fields.get(field)
    shape = (info and metavar(info)) or "KEY=VALUE"
    if found.group(2) in (EnvSettingsSource.__name__, Variables.__name__):
        name = env_name(settings_cls, field)
        value = next((v for k, v in os.environ.items() if k.upper() == name), "")
        return InvalidSetting(f"{name}: not valid JSON (got {_shown(value)})")
    given = getattr(parsed_args, field, None)
    shown = " ".join(given) if isinstance(given, list) else given
    return InvalidSetting(f"{flag_name(settings_cls, field)}: expected {shape} (got {shown})")


def invalid_setting(
    settings_cls: type[BaseSettings], exc: ValidationError, flags: Mapping[str, Any]
) -> InvalidSetting:
    """The first validation error, named after the source that gave the value."""
    error = exc.errors()[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    info = settings_cls.model_fields.get(field)
    problem = _phrase(error, info)
    if error["type"] != "value_error":  # the validators' own messages say what they got
        problem += f" (got {_shown(error['input'])})"
    if field in flags:
        return InvalidSetting(f"{flag_name(settings_cls, field)}: {problem}")
    env = EnvSettingsSource(settings_cls)()
    if field in env:
        return InvalidSetting(f"{env_name(settings_cls, field)}: {problem}")
    config = flags.get(CONFIG) or env.get(CONFIG)
    if config:
        return InvalidSetting(f"{config}: {field}: {problem}")
    return InvalidSetting(f"{field}: {problem}")


def refused(
    settings: BaseSettings, field: str, problem: str, parsed_args: Any = None
) -> InvalidSetting:
    """A value its type took, refused by a check made once the settings are read: the one line
    names where the value came from (the flag in `parsed_args`, the variable, the config file)."""
    settings_cls = type(settings)
    if parsed_args is not None and getattr(parsed_args, field, None) is not None:
        return InvalidSetting(f"{flag_name(settings_cls, field)}: {problem}")
    name = env_name(settings_cls, field)
    if any(key.upper() == name for key in os.environ):
        return InvalidSetting(f"{name}: {problem}")
    config = getattr(settings, CONFIG, None)
    return InvalidSetting(f"{config}: {field}: {problem}" if config else f"{field}: {problem}")


def _phrase(error: ErrorDetails, info: FieldInfo | None) -> str:
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"} and info:
        return _bounds(info)
    if kind.startswith("int_"):
        return "must be a whole number"
    if kind.startswith("float_"):
        return "must be a number"
    if kind.startswith("bool_"):
        return "must be true or false"
    if kind == "literal_error":
        return f"must be one of {context.get('expected')}"
    if kind == "dict_type":
        return "must be a mapping of names to values"
    if kind == "value_error":
        return str(context.get("error"))
    message = error["msg"]
    return message[:1].lower() + message[1:]


def _bounds(info: FieldInfo) -> str:
    """`must be between 0 and 65535`, `must be greater than 0 and at most 1`, ..."""
    low = next((m for m in info.metadata if isinstance(m, Gt | Ge)), None)
    high = next((m for m in info.metadata if isinstance(m, Lt | Le)), None)
    if isinstance(low, Ge) and isinstance(high, Le):
        return f"must be between {_number(low.ge)} and {_number(high.le)}"
    parts = []
    if isinstance(low, Gt):
        parts.append(f"greater than {_number(low.gt)}")
    elif isinstance(low, Ge):
        parts.append(f"at least {_number(low.ge)}")
    if isinstance(high, Lt):
        parts.append(f"less than {_number(high.lt)}")
    elif isinstance(high, Le):
        parts.append(f"at most {_number(high.le)}")
    return "must be " + " and ".join(parts)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _shown(value: Any) -> str:
    """A bad value as the user typed it: bare unless it is blank or not a string."""
    return value if isinstance(value, str) and value.strip() == value and value else repr(value)
