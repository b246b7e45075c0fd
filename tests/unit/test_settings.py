"""Settings from flags, HOTLORA_* variables and a TOML file: precedence, reach, one-line errors."""

from __future__ import annotations

import json
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic.fields import FieldInfo

from hotlora.config import sources
from hotlora.config.settings import Settings
from hotlora.config.settings_table import HEADER, settings_table
from hotlora.config.sources import CONFIG, env_name, flag_name, log_setting_notes
from hotlora.server.cli import build_parser, main, package_version, serve_settings

SETTINGS_DOC = Path(__file__).resolve().parents[2] / "config" / "SETTINGS.md"
# String settings whose validators want a particular form.
VALID_STRINGS = {
    "log_level": "debug",
    "allowed_origins": "https://a.example",
    "chat_template": "chatml",
}


@pytest.fixture(autouse=True)
def no_hotlora_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it means; the suite's HOTLORA_HOME is not one of them."""
    for name in [name for name in os.environ if name.startswith("HOTLORA_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `main(["serve", ...])` whose settings pass would start a server: fail instead."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the settings were accepted")

    monkeypatch.setattr("hotlora.server.app.create_app", refuse)


def serve(*flags: str) -> Settings:
    return serve_settings(build_parser().parse_args(["serve", *flags]))


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hotlora.toml"
    path.write_text(text)
    return path


# --- precedence -------------------------------------------------------------------------------


def test_a_flag_beats_a_variable_beats_the_file_beats_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    config = write_config(tmp_path, "port = 1001\nmax_batch = 3\nqueue_size = 5\n")
    monkeypatch.setenv("HOTLORA_PORT", "1002")
    monkeypatch.setenv("HOTLORA_MAX_BATCH", "4")
    settings = serve("--config", str(config), "--port", "1003")
    assert settings.port == 1003
    assert settings.max_batch == 4
    assert settings.queue_size == 5
    assert settings.prefill_chunk == Settings.model_fields["prefill_chunk"].default


def test_the_file_can_be_named_by_the_variable_and_the_flag_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    by_variable = write_config(tmp_path, "max_batch = 3\n")
    by_flag = tmp_path / "other.toml"
    by_flag.write_text("max_batch = 5\n")
    monkeypatch.setenv("HOTLORA_CONFIG", str(by_variable))
    assert serve().max_batch == 3
    assert Settings().max_batch == 3  # the app factory's own Settings() reads it too
    assert serve("--config", str(by_flag)).max_batch == 5


def test_a_flag_replaces_the_adapters_of_lower_sources_entry_by_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    config = write_config(tmp_path, '[startup_adapters]\nsft = "from-file"\ndpo = "from-file"\n')
    monkeypatch.setenv("HOTLORA_STARTUP_ADAPTERS", '{"sft": "from-env"}')
    settings = serve("--config", str(config), "--adapter", "dpo=from-flag")
    assert settings.startup_adapters == {"sft": "from-env", "dpo": "from-flag"}


def test_home_expands_the_user_directory():
    assert serve("--home", "~/elsewhere").home == Path("~/elsewhere").expanduser()
    assert Settings().home == Path("~/.cache/hotlora").expanduser()


# --- every setting from every source ----------------------------------------------------------


def _bounds(field: FieldInfo) -> tuple[float, float]:
    low, high = float("-inf"), float("inf")
    for meta in field.metadata:
        if isinstance(meta, Ge):
            low = float(meta.ge)  # type: ignore[arg-type]
        elif isinstance(meta, Gt):
            low = float(meta.gt) + 1e-3  # type: ignore[arg-type]
        elif isinstance(meta, Le):
            high = float(meta.le)  # type: ignore[arg-type]
        elif isinstance(meta, Lt):
            high = float(meta.lt) - 1e-3  # type: ignore[arg-type]
    return low, high


def sample(name: str, field: FieldInfo) -> Any:
    """A valid value for the setting that is not its default."""
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    default = field.get_default(call_default_factory=True)
    if kind is bool:
        return not default
    if typing.get_origin(kind) is Literal:
        return next(choice for choice in typing.get_args(kind) if choice != default)
    if typing.get_origin(kind) is dict:
        return {"sft": "/adapters/sft"}
    if kind in (int, float):
        low, high = _bounds(field)
        for value in (default + 1 if default is not None else None, low + 1, low, high / 2):
            if value is not None and low <= value <= high and value != default:
                return kind(value) if kind is int else float(value)
        raise AssertionError(f"no sample value for {name}")
    if kind is Path:
        return Path("/srv/hotlora-sample")
    if kind is str:
        return VALID_STRINGS.get(name, "sample")
    raise AssertionError(f"no sample value for {name} ({kind})")


FIELDS = [name for name in Settings.model_fields if name != CONFIG]


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_is_a_flag(name: str):
    value = sample(name, Settings.model_fields[name])
    flag = flag_name(Settings, name)
    if isinstance(value, bool):
        args = [flag if value else f"--no-{flag[2:]}"]
    elif isinstance(value, dict):
        args = [arg for key, path in value.items() for arg in (flag, f"{key}={path}")]
    else:
        args = [flag, str(value)]
    assert getattr(serve(*args), name) == value


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_is_a_variable(name: str, monkeypatch: pytest.MonkeyPatch):
    value = sample(name, Settings.model_fields[name])
    text = json.dumps(value) if isinstance(value, (bool, dict)) else str(value)
    monkeypatch.setenv(env_name(Settings, name), text)
    assert getattr(serve(), name) == value


@pytest.mark.parametrize("name", FIELDS)
def test_every_setting_is_a_file_key(name: str, tmp_path: Path):
    value = sample(name, Settings.model_fields[name])
    if isinstance(value, dict):
        toml = "{" + ", ".join(f"{key} = {json.dumps(v)}" for key, v in value.items()) + "}"
    elif isinstance(value, (bool, int, float)):
        toml = json.dumps(value)
    else:
        toml = json.dumps(str(value))
    config = write_config(tmp_path, f"{name} = {toml}\n")
    assert getattr(serve("--config", str(config)), name) == value


def test_every_setting_is_described_and_in_the_help(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} has no description (it is the help and the settings doc)"
        assert flag_name(Settings, name) in help_text


# --- one line for a bad value -----------------------------------------------------------------

FILE = "{file}"
BAD_VALUES = [
    # (flags, variables, config file text, the line on stderr)
    (["--port", "70000"], {}, None, "--port: must be between 0 and 65535 (got 70000)"),
    ([], {"HOTLORA_PORT": "70000"}, None, "HOTLORA_PORT: must be between 0 and 65535 (got 70000)"),
    ([], {}, "port = 70000", f"{FILE}: port: must be between 0 and 65535 (got 70000)"),
    (["--max-batch", "many"], {}, None, "--max-batch: must be a whole number (got many)"),
    (["--drain-timeout", "soon"], {}, None, "--drain-timeout: must be a number (got soon)"),
    (
        ["--default-top-p", "0"],
        {},
        None,
        "--default-top-p: must be greater than 0 and at most 1 (got 0)",
    ),
    ([], {}, "max_batch = 0", f"{FILE}: max_batch: must be at least 1 (got 0)"),
    (
        ["--cpu-weights", "fp8"],
        {},
        None,
        "--cpu-weights: must be one of 'auto', 'packed', 'float32' or 'mlx' (got fp8)",
    ),
    ([], {"HOTLORA_WARMUP": "maybe"}, None, "HOTLORA_WARMUP: must be true or false (got maybe)"),
    (
        ["--adapter", "no-equals-sign"],
        {},
        None,
        "--adapter: expected NAME=PATH (got no-equals-sign)",
    ),
    (
        ["--ray", "--adapter-memory-bytes", "1000"],
        {},
        None,
        "--ray: --adapter-memory-bytes does not apply with ray: its replicas mount the registry's "
        "adapters, up to --max-mounted-adapters each",
    ),
    (
        ["--adapter", "a=lib1", "--adapter", "b=lib3", "--adapter", "a=lib2"],
        {},
        None,
        "--adapter: 'a' given twice (a=lib1 and a=lib2)",
    ),
    (
        [],
        {"HOTLORA_STARTUP_ADAPTERS": "sft"},
        None,
        "HOTLORA_STARTUP_ADAPTERS: not valid JSON (got sft)",
    ),
    (
        [],
        {},
        'startup_adapters = "sft"',
        f"{FILE}: startup_adapters: must be a mapping of names to values (got sft)",
    ),
    (["--log-level", "loud"], {}, None, "--log-level: unknown log level 'loud'"),
    (
        ["--api-key", ""],
        {},
        None,
        "--api-key: an API key must not be empty; leave it unset to disable the check",
    ),
    ([], {}, "prot = 8001", f"{FILE}: prot: unknown setting (did you mean port?)"),
    ([], {}, "max-batch = 2", f"{FILE}: max-batch: unknown setting (did you mean max_batch?)"),
    ([], {}, 'config = "other.toml"', f"{FILE}: config: a config file cannot name another"),
    ([], {}, "port = ", f"{FILE}: not valid TOML: ..."),  # the parser's words follow
    (["--config", "nowhere.toml"], {}, None, "nowhere.toml: no such file"),
]


@pytest.mark.parametrize(("flags", "variables", "text", "line"), BAD_VALUES)
def test_a_bad_value_is_one_line_naming_the_setting_and_its_source(
    flags: list[str],
    variables: dict[str, str],
    text: str | None,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.chdir(tmp_path)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if text is not None:
        flags = [*flags, "--config", str(write_config(tmp_path, text + "\n"))]
    assert main(["serve", *flags]) == 2
    expected = "hotlora serve: " + line.replace(FILE, str(tmp_path / "hotlora.toml"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n")
    assert (
        err.startswith(expected.removesuffix("..."))
        if line.endswith("...")
        else err == expected + "\n"
    )


# --- a renamed setting's old name -------------------------------------------------------------


@pytest.fixture
def first_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a fresh process: no old name noted or logged yet."""
    monkeypatch.setattr(sources, "_setting_notes", {})
    monkeypatch.setattr(sources, "_logged_notes", set())


OLD_NAMES = [
    # (flags, variables, config file text, the warning)
    (
        ["--no-cpu-batch-matmul"],
        {},
        None,
        "--no-cpu-batch-matmul is the old name of --no-cpu-native-kernels",
    ),
    (
        [],
        {"HOTLORA_CPU_BATCH_MATMUL": "false"},
        None,
        "HOTLORA_CPU_BATCH_MATMUL is the old name of HOTLORA_CPU_NATIVE_KERNELS",
    ),
    (
        [],
        {},
        "cpu_batch_matmul = false",
        f"{FILE}: cpu_batch_matmul is the old name of cpu_native_kernels",
    ),
    # Given twice under old names, it is still one warning: the first source read.
    (
        ["--no-cpu-batch-matmul"],
        {"HOTLORA_CPU_BATCH_MATMUL": "false"},
        None,
        "--no-cpu-batch-matmul is the old name of --no-cpu-native-kernels",
    ),
]


@pytest.mark.parametrize(("flags", "variables", "text", "warning"), OLD_NAMES)
@pytest.mark.usefixtures("first_warnings")
def test_the_native_kernels_setting_takes_its_old_name_with_one_warning(
    flags: list[str],
    variables: dict[str, str],
    text: str | None,
    warning: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if text is not None:
        flags = [*flags, "--config", str(write_config(tmp_path, text + "\n"))]
    with caplog.at_level(logging.WARNING, logger="hotlora.config"):
        for _ in range(2):  # the settings read twice, the warnings logged twice: one line
            assert serve(*flags).cpu_native_kernels is False
            log_setting_notes()
    expected = warning.replace(FILE, str(tmp_path / "hotlora.toml")) + " (it still works)"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, expected)]


@pytest.mark.usefixtures("first_warnings")
def test_a_variable_that_nearly_names_a_setting_is_warned_of_and_others_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setenv("HOTLORA_MAX_BTACH", "4")  # misspelt: no effect, and said so
    monkeypatch.setenv("HOTLORA_VENV", "/opt/hotlora/venv")  # a container's own: not a setting
    with caplog.at_level(logging.WARNING, logger="hotlora.config"):
        for _ in range(2):
            assert serve().max_batch == 8
            log_setting_notes()
    assert [r.getMessage() for r in caplog.records] == [
        "HOTLORA_MAX_BTACH is not a setting and has no effect (did you mean HOTLORA_MAX_BATCH?)"
    ]


@pytest.mark.usefixtures("first_warnings")
def test_the_old_flag_keeps_its_place_among_the_sources_and_the_new_name_warns_of_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setenv("HOTLORA_CPU_NATIVE_KERNELS", "false")
    with caplog.at_level(logging.WARNING, logger="hotlora.config"):
        assert serve().cpu_native_kernels is False
        assert serve("--no-cpu-native-kernels").cpu_native_kernels is False
        log_setting_notes()
        assert not caplog.records
        assert serve("--cpu-batch-matmul").cpu_native_kernels is True  # a flag beats a variable
        log_setting_notes()
    [record] = caplog.records
    assert record.getMessage() == (
        "--cpu-batch-matmul is the old name of --cpu-native-kernels (it still works)"
    )


@pytest.mark.usefixtures("first_warnings")
def test_a_bad_value_under_the_old_name_is_told_with_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
):
    monkeypatch.setenv("HOTLORA_CPU_BATCH_MATMUL", "maybe")
    with caplog.at_level(logging.WARNING, logger="hotlora.config"):
        assert main(["serve"]) == 2
    assert caplog.messages == [
        "HOTLORA_CPU_BATCH_MATMUL is the old name of HOTLORA_CPU_NATIVE_KERNELS (it still works)"
    ]
    assert capsys.readouterr().err == (
        "hotlora serve: HOTLORA_CPU_NATIVE_KERNELS: must be true or false (got maybe)\n"
    )


def test_the_help_names_the_new_flag_only(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--cpu-native-kernels, --no-cpu-native-kernels" in help_text
    assert "--cpu-batch-matmul" not in help_text


# --- config/SETTINGS.md and the version ------------------------------------------------------


def test_the_settings_doc_table_is_the_generated_one():
    lines = SETTINGS_DOC.read_text().splitlines()
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    assert "\n".join(lines[start:end]) == settings_table(), (
        "regenerate it: python -m hotlora.config.settings_table"
    )


def test_version(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out == f"hotlora {package_version()}\n"
    assert re.fullmatch(r"\d+(\.\d+)*\S*", package_version())
