"""The NVFP4 prefill GEMMs at Qwen3.6-35B-A3B's sizes on the GPU: the grouped W4A16 kernels in every
configuration of the table and the tuner's (a prefix hit's 528-token tail and an 8k prefill), the
dequantize-then-bf16 path, the dense linear's dequantize-then-cuBLAS path, the pair-wise inline-PTX
decode bit for bit, and the tail replayed from a CUDA graph as the prefill graphs run it."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import moe as ref_moe
from freetoken.kernels import nvfp4 as ref
from gpu_checks import random_nvfp4
from kernel_checks import assert_close

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512


def _nvfp4():
    from freetoken.kernels.triton import nvfp4

    return nvfp4


def _configs():
    from freetoken.kernels.triton import nvfp4_configs

    return nvfp4_configs


@pytest.fixture(scope="module")
def experts():
    rng = torch.Generator().manual_seed(1234)
    return random_nvfp4(rng, EXPERTS, 2 * INTER, HIDDEN), random_nvfp4(rng, EXPERTS, HIDDEN, INTER)


def _routing(tokens: int, dtype: torch.dtype, seed: int):
    rng = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=rng).to(dtype).to(CUDA)
    logits = torch.randn(tokens, EXPERTS, generator=rng).to(dtype).to(CUDA)
    weights, ids = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    return x, weights, ids


def _table_configs() -> list:
    """Every configuration ``DEFAULT`` and ``TUNED`` hold, the tuner's candidates, and ``DEQUANT``."""
    import importlib.util
    import os
    import sys

    configs = _configs()
    found = {c for buckets in (*configs.DEFAULT.values(), *configs.TUNED.values()) for _, c in buckets}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("tune_nvfp4_moe", os.path.join(root, "benchmarks", "tune_nvfp4_moe.py"))
    tuner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tuner
    spec.loader.exec_module(tuner)
    for mean_rows in (16.5, 256):
        found.update(tuner.candidates(mean_rows, full=False, gemm="down"))
    found.update(tuner.tail_candidates("gate_up") + tuner.tail_candidates("down"))
    return sorted(found, key=lambda c: (c is not None, str(c)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [528, 8192])
def test_fused_experts_nvfp4_every_config(experts, dtype, tokens):
    """Each configuration, as gate/up and as down, against the reference (float32: its exact tiles)."""
    w13, w2 = experts
    x, weights, ids = _routing(tokens, dtype, tokens)
    want = ref.fused_experts_nvfp4_reference(x, *w13, *w2, weights, ids)
    for config in _table_configs():
        launched = None if config is None else _configs().for_dtype(config, dtype)
        got = _nvfp4().fused_experts_nvfp4_tiled(x, *w13, *w2, weights, ids, (launched, launched))
        try:
            assert_close(got, want)
        except AssertionError as exc:
            raise AssertionError(f"{launched}: {exc}") from exc
    assert_close(_nvfp4().fused_experts_nvfp4(x, *w13, *w2, weights, ids), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folded_decode_is_the_unfolded_bit_for_bit(experts, dtype):
    """``fold_bias`` at the tail (528 tokens): the tiles short of 2^8 and the row scales taking it
    back give the same bits as the two multiplies a pair, in gate/up and in down."""
    import dataclasses

    w13, w2 = experts
    x, weights, ids = _routing(528, dtype, 528)
    for config in _configs().TUNED[("gate_up", HIDDEN, INTER, EXPERTS)][1][1], _configs().C(16, 64, 128, 8, 4, 3, True):
        plain = _configs().for_dtype(config, dtype)
        folded = dataclasses.replace(plain, fold_bias=True)
        want = _nvfp4().fused_experts_nvfp4_tiled(x, *w13, *w2, weights, ids, (plain, plain))
        assert torch.equal(_nvfp4().fused_experts_nvfp4_tiled(x, *w13, *w2, weights, ids, (folded, folded)), want)


def test_decode_is_bit_exact_at_real_sizes(experts):
    """The dequantization kernel (the pair-wise PTX with the scale inside) equals the reference bit
    for bit over a whole expert stack: every code at every scale of the random draw."""
    w13, _ = experts
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(_nvfp4().dequantize_nvfp4(*w13, dtype), ref.dequantize_nvfp4(*w13, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [528, 1024, 8192])
@pytest.mark.parametrize("rows,cols", [(9216, 2048), (2048, 4096)])
@pytest.mark.parametrize("swap", [False, True])
def test_nvfp4_linear_prefill_sizes(dtype, tokens, rows, cols, swap, monkeypatch):
    """The W4A16 tiles below ``LINEAR_DEQUANT_MIN_ROWS`` (the table's, or the tuner's transposed
    256-row tile), dequantize-then-cuBLAS from it."""
    if swap:
        monkeypatch.setattr(_configs(), "LINEAR_TILES", ((float("inf"), (256, 128, 64, 8, 3, True)),))
    rng = torch.Generator().manual_seed(tokens + rows)
    w = random_nvfp4(rng, rows, cols)
    x = torch.randn(tokens, cols, generator=rng).to(dtype).to(CUDA)
    assert_close(_nvfp4().nvfp4_linear(x, *w), ref.nvfp4_linear_reference(x, *w))


def test_prefix_hit_tail_replays_from_a_cuda_graph(experts):
    """The 528-token tail in the prefill graphs' 640-token bucket: captured once, replayed on new
    activations and routing (the table's tiles come from the shapes only)."""
    w13, w2 = experts
    x, weights, ids = _routing(640, torch.bfloat16, 7)
    kernel = _nvfp4().fused_experts_nvfp4
    kernel(x, *w13, *w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, *w13, *w2, weights, ids)
    new_x, new_weights, new_ids = _routing(640, torch.bfloat16, 8)
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert_close(out, ref.fused_experts_nvfp4_reference(x, *w13, *w2, weights, ids))
