"""``benchmarks/phase_boundary.py``'s kernels against its torch chain. Under the interpreter they run
with one program (the persistent launch's barrier is then met at once); the compile check builds
them for sm_90, programmatic dependent launch included."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kernel_checks import DEVICE, assert_close


def _phase_boundary():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import phase_boundary
    finally:
        sys.path.pop(0)
    return phase_boundary


@pytest.mark.parametrize("has_weights", [True, False])
def test_every_variant_computes_the_chain(rng, has_weights):
    from freetoken.kernels.triton.moe_decode import _pdl_available

    bench = _phase_boundary()
    n, phases = 32, 3
    weights = None
    if has_weights:
        weights = (torch.randn(phases, n, n, generator=rng) * n**-0.5).to(torch.bfloat16).to(DEVICE)
    x0 = torch.randn(n, generator=rng).to(torch.bfloat16).to(DEVICE)
    found = bench.variants(block_n=n, pdl_ok=_pdl_available())
    assert set(found) >= {"launches", "persistent", "persistent, prefetch"}
    bufs = []
    for run in found.values():  # every variant launched before any check (the compile check builds them all)
        buf = torch.full((phases + 1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        buf[0] = x0
        run(weights, buf, torch.zeros(phases, dtype=torch.int32, device=DEVICE), phases)
        bufs.append(buf)
    for buf in bufs:
        for i in range(phases):  # each phase from the vector the kernel stored before it: one rounding
            assert_close(buf[i + 1].float(), bench.reference_phase(weights, buf[i], i).float(), torch.bfloat16)
