"""Session fixtures: the demo checkpoint (tests/oracle.py builds every checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oracle import DEMO, checkpoint


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The Qwen3.5 demo model's random float32 checkpoint."""
    return checkpoint(DEMO["qwen3_5_moe"])
