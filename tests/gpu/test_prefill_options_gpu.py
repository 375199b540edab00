"""Issue 10's prefill kernel options (chosen by benchmarks/prefill_sweep.py) against the torch
references at the model's sizes: the persistent grouped GEMMs, their TMA operands, half-size tail
tiles, 256-wide tiles and the row tiles from a map (``GemmConfig.persistent``, ``tma``,
``half_tail``, ``tile_map``), the attention prefill at head_dim 256 and 128 with the register cap
(``PREFILL_MAX_REGISTERS``) and other tiles."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from freetoken.kernels import attention as ref_attention
from freetoken.kernels import moe as ref_moe
from gpu_checks import CUDA, randn, triton_module

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
HQ, HKV, PAGE = 16, 2, 16


# The T=8192 configurations' options (benchmarks/prefill_sweep.py's moe_candidates): TMA operands,
# the half-size tail tile, two or three 4-warp programs an SM, the 256-wide output tile at one
# program an SM (bf16 only: float32 tiles are narrowed), the row tiles from a map
OPTIONS = {
    "pointers": dict(tma=False),
    "tma": dict(tma=True),
    "half_tail": dict(tma=False, half_tail=True),
    "tma_half_tail": dict(tma=True, half_tail=True),
    "pingpong_tma_half_tail": dict(tma=True, half_tail=True, num_warps=4, max_registers=0),
    "three_tma_half_tail": dict(tma=True, half_tail=True, num_warps=4, persistent=3, num_stages=2,
                                max_registers=168),
    "wide_tma_half_tail": dict(tma=True, half_tail=True, persistent=1, max_registers=0, wide=True),
    "tma_half_tail_map": dict(tma=True, half_tail=True, tile_map=True),
    "map": dict(tma=False, tile_map=True),
}


def _option_config(gemm: str, dtype: torch.dtype, option: dict):
    """The option on the base tile as the table's tiles run for ``dtype`` (float32's narrowed)."""
    from freetoken.kernels.triton.moe_configs import OPTION_BASE, fit_to_dtype

    option = dict(option)
    config = fit_to_dtype(OPTION_BASE[gemm], dtype)
    if option.pop("wide", False):
        option["block_n"] = 2 * config.block_n if gemm == "gate_up" else 256
    return replace(config, **{"persistent": 2, "max_registers": 128, **option})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_persistent_grouped_gemms(rng, check, monkeypatch, dtype, option):
    """The routed experts and the shared expert as the first row tiles, 2048 tokens, in the T=8192
    bucket's tiles (128-row tiles of ~64 pairs an expert: every expert's tile partial, about half of
    them half tiles under ``half_tail``), two programs an SM at 128 registers (the table's form at
    T >= 8k), with each option."""
    if option.startswith("wide") and dtype == torch.float32:
        pytest.skip("float32 tiles are narrowed: the wide tile is a bf16 option")
    moe = triton_module("moe")
    monkeypatch.setattr(moe, "moe_gemm_config", lambda gemm, dtype, *a: _option_config(gemm, dtype, OPTIONS[option]))
    tokens = 2048
    x = randn(rng, tokens, HIDDEN, dtype=dtype)
    w13 = randn(rng, EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    w2 = randn(rng, EXPERTS, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5)
    shared_w13 = randn(rng, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    shared_w2 = randn(rng, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5)
    logits = randn(rng, tokens, EXPERTS + 1, dtype=dtype)
    weights, ids = ref_moe.moe_topk_softmax_reference(logits[:, :EXPERTS], TOP_K, True)
    args = (x, w13, w2, weights, ids, shared_w13, shared_w2, logits[:, EXPERTS:])
    pairs, gated = moe.fused_experts_shared_pairs(*args)
    want_pairs, want_gated = ref_moe.fused_experts_shared_pairs_reference(*args)
    check(f"persistent_pairs_{option}", pairs, want_pairs, dtype)
    check(f"persistent_shared_{option}", gated, want_gated, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,tiles,registers", [(256, None, 0), (128, None, 0), (128, None, 128),
                                                      (128, (128, 128, 8, 2), 0)])
def test_attention_prefill(rng, check, monkeypatch, dtype, head_dim, tiles, registers):
    """Prefill chunks with cached prefixes and from an empty cache, a shuffled page table; the
    register cap (``PREFILL_MAX_REGISTERS``) at head_dim 128."""
    attention = triton_module("attention")
    monkeypatch.setattr(attention, "PREFILL_MAX_REGISTERS", registers)
    if tiles is not None and dtype != torch.float32:
        monkeypatch.setattr(attention, "_tile_sizes", lambda *a: tiles)
    context_lens, query_lens = [3000, 900, 1500, 333], [700, 900, 333, 333]
    pages = [-(-c // PAGE) for c in context_lens]
    num_pages = sum(pages) + 8
    perm = torch.randperm(num_pages - 1, generator=rng, device=CUDA) + 1
    table = torch.zeros(len(context_lens), max(pages), dtype=torch.int32, device=CUDA)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n].int()
        used += n
    cu = torch.tensor([0] + query_lens, device=CUDA).cumsum(0).int()
    seq_lens = torch.tensor(context_lens, dtype=torch.int32, device=CUDA)
    k_cache = randn(rng, num_pages, PAGE, HKV, head_dim, dtype=dtype)
    v_cache = randn(rng, num_pages, PAGE, HKV, head_dim, dtype=dtype)
    q_gate = randn(rng, sum(query_lens), HQ, 2 * head_dim, dtype=dtype)
    q, gate = q_gate[..., :head_dim], q_gate[..., head_dim:]
    args = (q, k_cache, v_cache, table, cu, seq_lens, head_dim**-0.5, max(query_lens))
    got = attention.paged_attention(*args, gate=gate)
    check(f"attention_d{head_dim}", got, ref_attention.paged_attention_reference(*args, gate=gate), dtype)

