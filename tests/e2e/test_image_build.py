"""The Docker images without Docker: the Dockerfiles' instructions, and their build step
(docker/build.sh) run for real into a fresh venv under a temporary root, its result checked."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hotlora.models.embedded import embedded_model_path

from tests.support.server_process import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "cpu": ROOT / "docker" / "Dockerfile.cpu",
    "cuda": ROOT / "docker" / "Dockerfile.cuda",
}
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
BUILD_TIMEOUT_S = 900


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), args.strip()))
        pending = ""
    return found


def args_of(dockerfile: Path, keyword: str) -> list[str]:
    return [args for kw, args in instructions(dockerfile) if kw == keyword]


def env_before(dockerfile: Path, keyword: str, containing: str = "") -> dict[str, str]:
    """The ENV values set before the first `keyword` instruction whose arguments hold
    `containing`."""
    env: dict[str, str] = {}
    for kw, args in instructions(dockerfile):
        if kw == keyword and containing in args:
            return env
        if kw == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(args))
    return env


def build_run(dockerfile: Path) -> str:
    """The RUN instruction that calls docker/build.sh."""
    runs = [args for args in args_of(dockerfile, "RUN") if "docker/build.sh" in args]
    assert len(runs) == 1, runs
    return runs[0]


def copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """Each COPY's sources (relative to the build context) and destination."""
    found = []
    for args in args_of(dockerfile, "COPY"):
        *sources, dest = shlex.split(args)
        found.append((sources, dest))
    return found


def healthcheck_command(dockerfile: Path) -> list[str]:
    """The HEALTHCHECK's exec-form command."""
    (args,) = args_of(dockerfile, "HEALTHCHECK")
    _, _, command = args.partition(" CMD ")
    return json.loads(command)


# --- the Dockerfiles, read ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", DOCKERFILES)
def test_the_image_runs_as_the_non_root_user_the_build_made(backend: str):
    dockerfile = DOCKERFILES[backend]
    (user,) = args_of(dockerfile, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid != "0"
    made = re.search(r"HOTLORA_UID=(\d+)", build_run(dockerfile))
    assert made is not None and made.group(1) == uid


@pytest.mark.parametrize("backend", DOCKERFILES)
def test_the_build_runs_the_script_with_its_backend(backend: str):
    run = build_run(DOCKERFILES[backend])
    assert re.search(rf"bash /src/docker/build\.sh /src {backend}(\s|$)", run), run


@pytest.mark.parametrize("backend", DOCKERFILES)
def test_the_adapter_root_is_a_volume(backend: str):
    dockerfile = DOCKERFILES[backend]
    (volume,) = args_of(dockerfile, "VOLUME")
    adapter_root = env_before(dockerfile, "USER")["HOTLORA_ADAPTER_ROOT"]
    assert json.loads(volume) == [adapter_root]


@pytest.mark.parametrize("backend", DOCKERFILES)
def test_the_health_check_asks_ready_with_python_alone(backend: str):
    command = healthcheck_command(DOCKERFILES[backend])
    assert command[:2] == ["python", "-c"]
    assert "/ready" in command[2] and "urllib" in command[2]


@pytest.mark.parametrize("backend", DOCKERFILES)
def test_every_package_folder_is_copied_and_nothing_else_is_sent(backend: str):
    tomllib = pytest.importorskip("tomllib")
    dockerfile = DOCKERFILES[backend]
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    copied = {source for sources, _ in copies(dockerfile) for source in sources}
    assert set(package_dirs.values()) | {"pyproject.toml", "README.md"} <= copied
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    assert "*" in ignore
    assert {line[1:] for line in ignore if line.startswith("!")} == copied


def test_only_the_cpu_image_preloads_openblas():
    assert env_before(DOCKERFILES["cpu"], "USER")["LD_PRELOAD"] == str(OPENBLAS)
    assert "LD_PRELOAD" not in env_before(DOCKERFILES["cuda"], "USER")


def test_the_cpu_image_has_the_compiler_mlx_builds_its_cpu_kernels_with():
    (packages,) = [a for a in args_of(DOCKERFILES["cpu"], "RUN") if "apt-get install" in a]
    assert "g++" in shlex.split(packages.partition("apt-get install")[2])


def test_the_cuda_image_starts_from_nvidia_cuda():
    (base,) = args_of(DOCKERFILES["cuda"], "FROM")
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base


# --- the health check and the entrypoint, run -------------------------------------------------


class _Ready(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(self.status if self.path == "/ready" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ready_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_healthcheck(port: int) -> int:
    _, flag, code = healthcheck_command(DOCKERFILES["cpu"])
    env = {**os.environ, "HOTLORA_PORT": str(port)}
    return subprocess.run([sys.executable, flag, code], env=env, timeout=30).returncode


def test_the_health_check_fails_when_no_server_runs():
    assert run_healthcheck(free_port()) != 0


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_the_health_check_follows_ready(ready_server: ThreadingHTTPServer, status: int, healthy):
    handler = type("Handler", (_Ready,), {"status": status})
    ready_server.RequestHandlerClass = handler
    assert (run_healthcheck(ready_server.server_address[1]) == 0) is healthy


def preloaded_env(**env: str) -> dict[str, str]:
    """This environment with OpenBLAS preloaded and no OPENBLAS_CORETYPE unless given."""
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    return {**base, "LD_PRELOAD": str(OPENBLAS), **env}


def entrypoint_coretype(**env: str) -> str:
    script = ROOT / "docker" / "entrypoint-cpu.sh"
    result = subprocess.run(
        ["sh", str(script), "sh", "-c", 'printf %s "${OPENBLAS_CORETYPE:-}"'],
        env=preloaded_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout


@pytest.mark.skipif(not OPENBLAS.exists(), reason="Debian's OpenBLAS is not installed")
def test_the_entrypoint_names_openblas_kernels_only_when_it_falls_back():
    assert entrypoint_coretype(OPENBLAS_CORETYPE="Zen") == "Zen"
    probe = subprocess.run(
        ["/bin/true"],
        env=preloaded_env(OPENBLAS_VERBOSE="2"),
        capture_output=True,
        text=True,
    )
    fell_back = "Core: Prescott" in probe.stdout + probe.stderr
    assert (entrypoint_coretype() in ("SkylakeX", "Haswell")) is fell_back


# --- docker/build.sh, run ---------------------------------------------------------------------


@dataclass
class Build:
    root: Path  # stands for the image's /
    env: dict[str, str]
    output: str
    calls: list[str]  # groupadd, useradd and chown, as the build called them

    @property
    def venv(self) -> Path:
        return Path(self.env["HOTLORA_VENV"])

    @property
    def home(self) -> Path:
        return Path(self.env["HOTLORA_HOME"])


def stage(dockerfile: Path, root: Path) -> None:
    """The Dockerfile's COPY instructions, with `root` for the image's /."""
    for sources, dest in copies(dockerfile):
        target = root / dest.lstrip("/")
        for source in sources:
            path = ROOT / source
            to = target / path.name if dest.endswith("/") else target
            to.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(path, to)


def stub_user_tools(root: Path) -> Path:
    """groupadd, useradd and chown that only log their arguments: this machine is no image."""
    bin_dir, log = root / "stub-bin", root / "user-calls.log"
    bin_dir.mkdir()
    for tool in ("groupadd", "useradd", "chown"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{log}"\n')
        stub.chmod(0o755)
    return bin_dir


def build_env(dockerfile: Path, root: Path, **extra: str) -> dict[str, str]:
    """The ENV in force at the build step, its paths moved under `root`."""
    env = {
        key: str(root / value.lstrip("/")) if value.startswith("/") else value
        for key, value in env_before(dockerfile, "RUN", "docker/build.sh").items()
    }
    path = f"{stub_user_tools(root)}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, **env, "PATH": path, "PYTHON": sys.executable, **extra}


@pytest.fixture(scope="module")
def cpu_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The CPU image's build step, run as its RUN line says, into a fresh venv under a temp root."""
    dockerfile = DOCKERFILES["cpu"]
    root = tmp_path_factory.mktemp("image")
    stage(dockerfile, root)
    env = build_env(dockerfile, root)
    command = build_run(dockerfile).replace("/src", str(root / "src"))
    result = subprocess.run(
        ["bash", "-c", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    log = root / "user-calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return Build(root, env, result.stdout, calls)


def test_the_build_imports_the_embedded_model_into_the_home(cpu_build: Build):
    model = embedded_model_path(cpu_build.home)
    assert (model / "config.json").is_file()
    assert list(model.glob("*.safetensors"))
    assert f"importing with MLX from {cpu_build.venv}" in cpu_build.output


def test_the_console_script_runs(cpu_build: Build):
    result = subprocess.run(
        [str(cpu_build.venv / "bin" / "hotlora"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_the_build_makes_the_user_owner_of_home_and_adapters(cpu_build: Build):
    home, adapters = cpu_build.home, Path(cpu_build.env["HOTLORA_ADAPTER_ROOT"])
    assert adapters.is_dir()
    assert "groupadd --system --gid 10001 hotlora" in cpu_build.calls
    useradd = next(call for call in cpu_build.calls if call.startswith("useradd "))
    assert "--uid 10001" in useradd and useradd.endswith(" hotlora")
    assert f"chown -R 10001:10001 {home} {adapters}" in cpu_build.calls
    # The venv is not handed over: the server cannot rewrite its own code.
    assert not any(str(cpu_build.venv) in call for call in cpu_build.calls)


def test_the_cuda_images_import_runs_on_a_cpu_copy_of_mlx(cpu_build: Build, tmp_path: Path):
    """Without a GPU in a docker build, the CUDA image imports the model on MLX's CPU backend
    installed aside; here the same step runs in the CPU venv, the copy shadowing its MLX."""
    stage(DOCKERFILES["cpu"], tmp_path)
    home = tmp_path / "home"
    env = {
        **cpu_build.env,
        "HOTLORA_HOME": str(home),
        "HOTLORA_IMPORT_ON_CPU_COPY": "1",
        "HOTLORA_USER": "",
    }
    result = subprocess.run(
        ["bash", str(tmp_path / "src/docker/build.sh"), str(tmp_path / "src"), "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    mlx_dir = re.search(r"importing with MLX from (\S+)", result.stdout)
    assert mlx_dir is not None and not mlx_dir.group(1).startswith(str(cpu_build.venv))
    assert not Path(mlx_dir.group(1)).exists()  # removed once the import is done
    assert (embedded_model_path(home) / "config.json").is_file()
