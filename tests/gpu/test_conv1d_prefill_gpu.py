"""The conv1d prefill kernel against its torch reference at the model's 8192 channels: an 8k-token
chunk of one request, and a step of 37 requests (lengths 1..3000) whose slots hold windows; the
default tiles and the variants benchmarks/bench_conv1d_prefill.py --sweep times."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import conv1d as ref_conv

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
CHANNELS, WIDTH = 2 * 16 * 128 + 32 * 128, 4
PACKED = CHANNELS + 32 * 128 + 2 * 32
LENS = {"8k": [8192], "37 mixed": [1, 2, 3, 500, 77] * 7 + [3000, 1111]}
# PrefillTiles fields; the Triton module is imported inside the test: a module-level import at
# collection would load the kernels before the CPU suite's conftest switches the interpreter on.
TILES = [
    None,  # the default
    dict(rows=16, channels=128, warps=1, unroll=4),
    dict(rows=64, channels=512, warps=2, unroll=8),
    dict(rows=32, channels=1024, warps=4, unroll=8, maxnreg=128),
]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "default" if t is None else f"{t['rows']}x{t['channels']}")
@pytest.mark.parametrize("case", sorted(LENS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_prefill_real_size(rng, check, monkeypatch, dtype, case, tiles):
    from freetoken.kernels.triton import conv1d

    if tiles is not None:
        monkeypatch.setattr(conv1d, "prefill_tiles", lambda *_: conv1d.PrefillTiles(**tiles))
    lens = LENS[case]
    x = torch.randn(sum(lens), PACKED, generator=rng, device=CUDA).to(dtype)[:, :CHANNELS]
    weight = (torch.randn(CHANNELS, WIDTH, generator=rng, device=CUDA) * 0.5).to(dtype)
    state = torch.randn(len(lens) + 3, CHANNELS, WIDTH - 1, generator=rng, device=CUDA).to(dtype)
    slots = torch.randperm(len(lens) + 3, generator=rng, device=CUDA)[: len(lens)].int()
    cu = torch.tensor([0] + lens, device=CUDA).cumsum(0).int()
    want_state = state.clone()
    want = ref_conv.causal_conv1d_prefill_reference(x, weight, want_state, slots, cu)
    check(f"conv1d_prefill_{case}", conv1d.causal_conv1d_prefill(x, weight, state, slots, cu), want, dtype)
    assert torch.equal(state, want_state)
