"""Session fixtures: tiny random checkpoints built with transformers (see oracle.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.demo import build_checkpoint
from oracle import CHECKPOINT_SHAPES


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    built: dict[str, Path] = {}

    def make(name: str, dtype: torch.dtype = torch.float32) -> Path:
        key = f"{name}-{str(dtype).removeprefix('torch.')}"
        if key not in built:
            built[key] = build_checkpoint(tmp_path_factory.mktemp(key), dtype=dtype, seed=7, **CHECKPOINT_SHAPES[name])
        return built[key]

    return make


@pytest.fixture(scope="session")
def demo_checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory("demo")
