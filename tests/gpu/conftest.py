"""Tests under tests/gpu need a real NVIDIA GPU; everywhere else (CI, laptops) they are skipped.

A GPU counts as present when ``nvidia-smi -L`` runs and lists at least one ``GPU n:`` line. These
tests only read: none of them may change MIG mode, create or destroy an instance, or reset a GPU.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest


@functools.cache
def gpu_listing() -> tuple[bool, str]:
    """(a GPU is present, why not / the ``nvidia-smi -L`` lines), asked once per session."""
    if shutil.which("nvidia-smi") is None:
        return False, "nvidia-smi is not installed"
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"nvidia-smi -L failed: {exc}"
    if done.returncode != 0:
        return False, f"nvidia-smi -L exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU ")]
    if not lines:
        return False, "nvidia-smi -L lists no GPU"
    return True, "\n".join(lines)


def require_gpu() -> None:
    """Skip the calling test unless a GPU is present."""
    present, why = gpu_listing()
    if not present:
        pytest.skip(f"no NVIDIA GPU: {why}")


@pytest.fixture
def gpu() -> str:
    """A test that takes this fixture is skipped where no GPU is present; it gets the GPU listing."""
    require_gpu()
    return gpu_listing()[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything collected in this folder belongs to the GPU suite: mark it so `-m "not gpu"` deselects
    # it. Skipping is left to the `gpu` fixture, so GPU-free checks here (parsers) still run in CI.
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
