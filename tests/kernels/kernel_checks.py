"""Shared by the kernel tests: the device they run on and the error bounds."""

from __future__ import annotations

import pytest
import torch

# The CPU runs the kernels through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Relative L2 bounds: float32 arithmetic in a different order stays far below 1e-5; bf16 outputs
# carry one rounding (2**-9 relative) on top of differences in where intermediates are rounded.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 4e-3}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0) -> None:
    """Same shape, every element finite where the reference is, relative L2 error within the dtype's bound."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isfinite(got.cpu()), torch.isfinite(want.cpu())), "unwritten (NaN) or non-finite elements"
    finite = torch.isfinite(want)
    bound = REL_TOL[dtype or want.dtype] * scale
    err = rel_error(got[finite], want[finite])
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g}"


def assert_as_launched(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two launches that compute the same thing alike: bit for bit under the interpreter (every sum in
    order, no contraction); compiled, within two units of the dtype's rounding, since a compiled
    sum's order follows its tile and warps, and ptxas contracts a float32 ``a · b + c`` into one FMA
    where the code allows (seen on the H100 in the fused norm + GEMV and its conv step, session 37)."""
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(want.dtype).eps, atol=1e-6)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every buffer the kernel wrappers allocate poisoned (NaN / -1), so unwritten elements fail; and
    float32 references in true float32: a bf16 engine test run before in the same process (an xdist
    worker's) leaves TF32 on (``engine.configure_precision``), and the float32 checks then fail at
    ~5e-4 relative error (seen on an H100, session 35). Used by tests/kernels' and tests/gpu's conftest."""
    from freetoken.kernels.triton import _common

    monkeypatch.setattr(_common, "poison_outputs", True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
