"""Session fixtures: the demo checkpoint (tests/oracle.py builds every checkpoint); start-up objects
unfrozen after each test."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from oracle import DEMO, checkpoint


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The Qwen3.5 demo model's random float32 checkpoint."""
    return checkpoint(DEMO["qwen3_5_moe"])


@pytest.fixture(autouse=True)
def _unfreeze_garbage_collector():
    """Every ``Runtime`` freezes what is alive at its start (``runtime.freeze_startup_objects``): a
    server keeps it for its life, but a test's engine dies with the test, and frozen objects in
    reference cycles are never collected. Unfrozen after each test, they can be."""
    yield
    gc.unfreeze()
