"""GPU suite (``pytest -m gpu``): every Triton kernel against its torch reference at the real model
sizes, and the engine end to end on CUDA. Skipped by default (pyproject's ``-m 'not gpu ...'``).

Buffers the kernel wrappers allocate are poisoned (NaN / -1) before every test, so unwritten
elements fail. ``FREETOKEN_GPU_REPORT=<file>`` appends one JSON line per checked tensor (name,
dtype, relative error, bound) for scripts/gpu_check.sh's summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))  # kernel_checks
from kernel_checks import poisoned_outputs  # noqa: E402, F401  (autouse)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.fixture
def check(request):
    """``check(name, got, want, dtype, scale=1)``: assert_close, and record the error if asked to."""
    from kernel_checks import REL_TOL, assert_close, rel_error

    def run(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
        finite = torch.isfinite(want)
        err = rel_error(got[finite], want[finite]) if got.shape == want.shape else float("nan")
        report = os.environ.get("FREETOKEN_GPU_REPORT")
        if report:
            with open(report, "a") as f:
                row = dict(test=request.node.name, name=name, dtype=str(dtype).removeprefix("torch."),
                           rel_error=err, bound=REL_TOL[dtype] * scale)
                f.write(json.dumps(row) + "\n")
        assert_close(got, want, dtype=dtype, scale=scale)

    return run
