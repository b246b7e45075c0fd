"""Every command in every doc runs as written, and every link in every doc resolves.

The fenced shell blocks (sh, bash, shell, console) of every .md file in the repository are
checked: each block passes `bash -n`; each `make TARGET` names a Makefile target; each `hotlora`
command parses with the real CLI parser and names only its subcommand's flags; each
`python -m MODULE` names an importable module whose `--help` lists the flags given to it; each
repository path a command names exists; and the commands that are safe to run here (`make -n`
of every target named, `--help`, `--version`, the settings table) run and exit 0. A block after
`<!-- not run: REASON -->` is checked but not run. Relative links, anchors included, must point
at files and headings that exist."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotlora.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SHELLS = {"sh", "bash", "shell", "console"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>&1", "&>"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Commands run as written: they read or print, and change nothing.
SAFE_MODULES = {"hotlora.config.settings_table"}
RUN_TIMEOUT = 300


@dataclass(frozen=True)
class Block:
    """One fenced shell block: where it is, its text, and why it is not run (None: it is)."""

    doc: Path
    line: int
    text: str
    not_run: str | None

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """Every .md file of the repository, not under a hidden folder (.git, .venv, caches)."""
    return sorted(
        path
        for path in ROOT.rglob("*.md")
        if not any(
            part.startswith(".") or part.endswith(".egg-info")
            for part in path.relative_to(ROOT).parts[:-1]
        )
    )


def _fences(lines: list[str]) -> Iterator[tuple[int, int, str]]:
    """(opening line index, closing line index, language) of each fenced block."""
    opened: tuple[int, str, str] | None = None
    for i, line in enumerate(lines):
        found = FENCE.match(line)
        if not found:
            continue
        if opened is None:
            opened = (i, found.group(1), found.group(2).lower())
        elif found.group(1) == opened[1] and not found.group(2):
            yield opened[0], i, opened[2]
            opened = None


def shell_blocks(doc: Path) -> list[Block]:
    lines = doc.read_text().splitlines()
    blocks = []
    for start, end, language in _fences(lines):
        if language not in SHELLS:
            continue
        before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        marker = NOT_RUN.search(before)
        body = lines[start + 1 : end]
        if language == "console":  # only the prompt lines are commands
            body = [line.split("$ ", 1)[1] for line in body if line.lstrip().startswith("$ ")]
        blocks.append(Block(doc, start + 1, "\n".join(body) + "\n", marker and marker.group(1)))
    return blocks


@functools.cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(block for doc in doc_files() for block in shell_blocks(doc))


@dataclass(frozen=True)
class Command:
    """One simple command of a block: its environment assignments and its words."""

    block: Block
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name

    def __str__(self) -> str:
        return f"{self.block}: {shlex.join(self.argv)}"


def _without_comments(text: str) -> str:
    """The text without its comments: from a # that starts a word, outside quotes, to the end
    of its line."""
    kept, quote, comment = [], "", False
    for i, char in enumerate(text):
        if comment:
            comment = char != "\n"
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            comment = True
        if not comment:
            kept.append(char)
    return "".join(kept)


def commands(block: Block) -> list[Command]:
    """The block's simple commands: lines joined at backslashes, comments dropped, split at
    `&&`, `||`, `;` and pipes, redirections and leading VAR=value assignments set aside."""
    text = _without_comments(block.text.replace("\\\n", " "))
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace = " \t\r"  # a newline ends a command
    lexer.wordchars += "~-./:=@%+,*[]{}$?#"
    found: list[Command] = []
    words: list[str] = []

    def flush() -> None:
        env = []
        while words and ASSIGNMENT.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env.append((name, value))
        if words:
            found.append(Command(block, tuple(env), tuple(words)))
        words.clear()

    skip_next = False
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the bash -n test names the block
        return []
    for token in tokens:
        if token == "\n":
            flush()
        elif skip_next:
            skip_next = False
        elif token in OPERATORS:
            flush()
        elif token in REDIRECTS:
            skip_next = True
        else:
            words.append(token)
    flush()
    return found


def all_commands() -> list[Command]:
    return [command for block in all_blocks() for command in commands(block)]


def _report(what: str, count: int, failures: list[str]) -> None:
    print(f"\n{what}: {count} checked, {len(failures)} failed")
    assert count > 0, f"no {what} found in the docs"
    assert not failures, "\n".join(failures)


# --- the blocks ---------------------------------------------------------------------------------


def test_every_doc_has_been_found():
    docs = doc_files()
    names = {doc.relative_to(ROOT).as_posix() for doc in docs}
    assert {"README.md", "server/API.md", "config/SETTINGS.md", "tests/README.md"} <= names
    blocks = all_blocks()
    not_run = [f"{block} ({block.not_run})" for block in blocks if block.not_run]
    print(f"\n{len(docs)} docs, {len(blocks)} shell blocks, {len(not_run)} not run:")
    print("\n".join(not_run))


def test_every_shell_block_passes_bash_n():
    failures = []
    for block in all_blocks():
        out = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
        if out.returncode:
            failures.append(f"{block}: {out.stderr.strip()}")
    _report("shell blocks (bash -n)", len(all_blocks()), failures)


# --- make -----------------------------------------------------------------------------------------


@functools.cache
def make_targets() -> frozenset[str]:
    makefile = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", makefile, flags=re.MULTILINE))


def _make_goals(command: Command) -> tuple[str, ...]:
    return tuple(w for w in command.argv[1:] if not w.startswith("-") and "=" not in w)


def test_every_make_target_is_in_the_makefile():
    failures, count = [], 0
    for command in all_commands():
        if command.program != "make":
            continue
        for goal in _make_goals(command):
            count += 1
            if goal not in make_targets():
                failures.append(f"{command}: no target {goal!r} in the Makefile")
    _report("make targets", count, failures)


# --- hotlora --------------------------------------------------------------------------------------


@functools.cache
def hotlora_flags() -> dict[str | None, frozenset[str]]:
    """Each subcommand's option strings (None: the top-level parser's), from the real parser."""
    parser = build_parser()
    flags: dict[str | None, frozenset[str]] = {None: frozenset(parser._option_string_actions)}
    for action in parser._subparsers._group_actions:
        for name, sub in action.choices.items():
            options = set(sub._option_string_actions)
            # A subcommand with actions of its own (`hotlora keys add`): their flags too.
            for nested in sub._subparsers._group_actions if sub._subparsers else ():
                for inner in nested.choices.values():
                    options |= set(inner._option_string_actions)
            flags[name] = frozenset(options)
    return flags


def test_every_hotlora_command_names_real_flags_and_parses():
    failures, count = [], 0
    for command in all_commands():
        if command.program != "hotlora":
            continue
        count += 1
        args = list(command.argv[1:])
        sub = next((a for a in args if not a.startswith("-")), None)
        if sub is not None and sub not in hotlora_flags():
            failures.append(f"{command}: no subcommand {sub!r}")
            continue
        for word in args:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in hotlora_flags()[sub]:
                failures.append(f"{command}: `hotlora {sub or ''}` has no flag {flag}")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                build_parser().parse_args(args)
            except SystemExit as exit_:
                if exit_.code not in (0, None):
                    failures.append(f"{command}: {err.getvalue().strip()}")
    _report("hotlora commands", count, failures)


# --- python -m ------------------------------------------------------------------------------------


def _module_of(command: Command) -> str | None:
    if not re.fullmatch(r"python(3(\.\d+)?)?", command.program):
        return None
    argv = command.argv
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None


@functools.cache
def module_help(module: str) -> str | None:
    """`python -m MODULE --help`'s output where the module parses its arguments with argparse;
    None where it does not (running it with --help would do its work)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin)
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        source = source.parent / "__main__.py"
    if "ArgumentParser" not in source.read_text():
        return None
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert out.returncode == 0, f"python -m {module} --help: {out.stderr}"
    return out.stdout


def test_every_python_module_is_importable_and_takes_its_flags():
    failures, count = [], 0
    for command in all_commands():
        module = _module_of(command)
        if module is None:
            continue
        count += 1
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            failures.append(f"{command}: no module {module}")
            continue
        flags = [w.split("=", 1)[0] for w in command.argv if w.startswith("--")]
        help_text = module_help(module)
        if help_text is None:
            if flags:
                failures.append(f"{command}: {module} takes no flags")
            continue
        for flag in flags:
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                failures.append(f"{command}: {flag} is not in `python -m {module} --help`")
    _report("python -m commands", count, failures)


# --- paths ----------------------------------------------------------------------------------------


@functools.cache
def top_level() -> frozenset[str]:
    return frozenset(path.name for path in ROOT.iterdir() if path.name != ".git")


def _repo_paths(command: Command) -> Iterator[str]:
    """The words of a command that name a path inside the repository."""
    for word in command.argv:
        for candidate in (word, word.split("=", 1)[-1]):
            path = candidate.split("::", 1)[0]
            first = path.split("/", 1)[0]
            if first in top_level() and ("/" in path or (ROOT / path).is_file()):
                yield path
                break


def test_every_repository_path_a_command_names_exists():
    failures, count = [], 0
    for command in all_commands():
        for path in _repo_paths(command):
            count += 1
            if not (ROOT / path).exists():
                failures.append(f"{command}: no {path} in the repository")
    _report("repository paths", count, failures)


# --- what runs ------------------------------------------------------------------------------------


def _runs(command: Command) -> tuple[str, ...] | None:
    """The argv to run for a command that is safe to run here, or None."""
    argv = command.argv
    if command.program == "make":
        goals = _make_goals(command)
        return ("make", "-n", *goals) if goals else None
    if "--help" in argv or "--version" in argv or _module_of(command) in SAFE_MODULES:
        return argv
    return None


def test_the_safe_commands_run_as_written():
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    failures, ran, seen = [], 0, set()
    for command in all_commands():
        argv = _runs(command)
        if argv is None or command.block.not_run:
            continue
        key = (command.env, argv)
        if key in seen:
            continue
        seen.add(key)
        ran += 1
        module = _module_of(command)
        if module and argv[argv.index("-m") + 2 :] == ("--help",) and not command.env:
            assert module_help(module) is not None, f"{command}: {module} has no --help"
            continue  # run once already, for its flags
        out = subprocess.run(
            list(argv),
            cwd=ROOT,
            env={**env, **dict(command.env)},
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        print(f"ran: {shlex.join(argv)} (rc {out.returncode})")
        if out.returncode:
            failures.append(f"{command}: exit {out.returncode}\n{out.stderr[-2000:]}")
    _report("commands run", ran, failures)


# --- links ----------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_fences(doc: Path) -> str:
    """The doc's text with its fenced blocks blanked out."""
    lines = doc.read_text().splitlines()
    for start, end, _ in list(_fences(lines)):
        for i in range(start, end + 1):
            lines[i] = ""
    return "\n".join(lines)


@functools.cache
def anchors(doc: Path) -> frozenset[str]:
    """The anchors GitHub gives the doc's headings: lower case, punctuation dropped but `-` and
    `_`, spaces to `-`, a repeated heading numbered."""
    seen: dict[str, int] = {}
    for line in _outside_fences(doc).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower().replace("`", "")).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return frozenset(seen)


def test_every_relative_link_resolves():
    failures, count = [], 0
    for doc in doc_files():
        prose = re.sub(r"`[^`\n]*`", "", _outside_fences(doc))  # no links in inline code
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):
                continue
            count += 1
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: ({target})"
            if not resolved.exists():
                failures.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                failures.append(f"{where}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    _report("relative links", count, failures)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("make run  # serve\n", [("make", "run")]),
        ("A=1 B=2 make -n setup && make test\n", [("make", "-n", "setup"), ("make", "test")]),
        ("curl -s x \\\n  -d '{\"a\": 1}' > out.json\n", [("curl", "-s", "x", "-d", '{"a": 1}')]),
    ],
)
def test_commands_are_read_as_bash_reads_them(text: str, expected: list[tuple[str, ...]]):
    block = Block(ROOT / "README.md", 1, text, None)
    assert [c.argv for c in commands(block)] == expected
