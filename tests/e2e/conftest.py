"""The end-to-end tier's fixtures: adapters really trained on the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trained_adapters import TrainedAdapters, ensure_all


@pytest.fixture(scope="session")
def trained_adapters(embedded_model_dir: Path, hotlora_home: Path) -> TrainedAdapters:
    """Both test adapters under the test home's adapter root; trained once, then reused."""
    return ensure_all(embedded_model_dir, hotlora_home / "adapters")
