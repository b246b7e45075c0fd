"""What every tier shares: where tests keep their caches, the tiny model, the embedded model.

The test home is set here, once, before any test builds settings: the embedded model's import
and the trained test adapters are cached under `.cache/test-home` in the checkout (ignored by
git), never in the user's home. Subprocesses inherit it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hotlora.models.embedded import ensure_embedded_model

from tests.support.tiny import write_tiny_llama

TEST_HOME = Path(__file__).resolve().parent.parent / ".cache" / "test-home"

os.environ["HOTLORA_HOME"] = str(TEST_HOME)
# Anything that caches by the usual conventions (Hugging Face, XDG) caches here too.
os.environ["HF_HOME"] = str(TEST_HOME / "huggingface")
os.environ["XDG_CACHE_HOME"] = str(TEST_HOME / "xdg")
# And whatever writes under the home directory (Ray's token, Chromium's profile data) writes here.
(TEST_HOME / "home").mkdir(parents=True, exist_ok=True)
os.environ["HOME"] = str(TEST_HOME / "home")


@pytest.fixture(scope="session")
def hotlora_home() -> Path:
    """The HOTLORA_HOME every test, and every process a test starts, sees."""
    return TEST_HOME


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), quantize=True)


@pytest.fixture(scope="session")
def embedded_model_dir(hotlora_home: Path) -> Path:
    """The embedded model, imported into the test home once and reused by later runs."""
    return ensure_embedded_model(hotlora_home)


@pytest.fixture(scope="session")
def embedded_model_id(embedded_model_dir: Path) -> str:
    """The id a server started on the embedded model (and no --served-model-name) serves."""
    return embedded_model_dir.name
