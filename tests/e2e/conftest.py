"""The end-to-end tier's fixtures: adapters really trained on the embedded model, one server
serving them for the modules that only read, and headless Chromium for the browser tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.support.server_process import ServerProcess, hotlora_spec
from tests.support.trained_adapters import TrainedAdapters, ensure_all


@pytest.fixture(scope="session")
def trained_adapters(embedded_model_dir: Path, hotlora_home: Path) -> TrainedAdapters:
    """Both test adapters under the test home's adapter root; trained once, then reused."""
    return ensure_all(embedded_model_dir, hotlora_home / "adapters")


@pytest.fixture(scope="session")
def pirate_server(
    embedded_model_dir: Path, trained_adapters: TrainedAdapters
) -> Iterator[ServerProcess]:
    """The embedded model with the `pirate` adapter mounted, shared by modules that only send
    requests (they mount nothing and change no setting)."""
    spec = hotlora_spec("--model", str(embedded_model_dir), *trained_adapters.serve_args("pirate"))
    with ServerProcess(spec) as srv:
        yield srv


@pytest.fixture(scope="session")
def pirate_client(pirate_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{pirate_server.url}/v1", api_key="unused", max_retries=0, timeout=180
    )


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Debian's Chromium, headless, driven by playwright (whose own download does not work)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH: `make setup` installs it (apt-get install chromium)")
    # Without the BLAS preloaded for MLX (`make test`): Chromium's GPU process dies of it.
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, env=env)
        yield browser
        browser.close()
