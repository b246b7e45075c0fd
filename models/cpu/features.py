"""What this CPU offers the kernels: whether it is x86-64 Linux, and the feature flags it lists."""

from __future__ import annotations

import platform
import sys
from pathlib import Path


def x86_64_linux() -> bool:
    """Whether this is an x86-64 machine running Linux: MLX's JIT flags apply there, and the
    CPU kernels serve it (arm64 Linux too)."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags as Linux lists them; empty where it does not."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
