"""The fused attention prologue against its torch reference at Qwen3.6-35B-A3B's sizes (16 query /
2 KV heads of 256, rotary 64, pages of 16). Fresh random inputs, poisoned outputs;
bounds as tests/gpu/test_kernels_real_sizes.py's."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import attention_prologue as ref_prologue
from freetoken.kernels.rotary import build_rotary_cache
from gpu_checks import CUDA, randn, triton_module

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
HQ, HKV, HEAD_DIM, ROTARY_DIM, PAGE = 16, 2, 256, 64, 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 777])
def test_norm_rotary_store_kv(rng, check, dtype, tokens):
    kernel = triton_module("attention_prologue").norm_rotary_store_kv
    packed = randn(rng, tokens, HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM, dtype=dtype)  # the qkv_proj output
    q = packed[:, : HQ * 2 * HEAD_DIM].view(tokens, HQ, 2 * HEAD_DIM)[..., :HEAD_DIM]
    k, v = packed[:, HQ * 2 * HEAD_DIM :].view(tokens, 2, HKV, HEAD_DIM).unbind(1)
    q_w, k_w = randn(rng, HEAD_DIM, dtype=dtype, scale=0.2), randn(rng, HEAD_DIM, dtype=dtype, scale=0.2)
    cache = build_rotary_cache(ROTARY_DIM, 32768, 1e7, CUDA)
    positions = torch.randint(0, 32768, (tokens,), generator=rng, device=CUDA)
    num_pages = tokens // PAGE + 9
    k_cache = randn(rng, num_pages, PAGE, HKV, HEAD_DIM, dtype=dtype)
    v_cache = randn(rng, num_pages, PAGE, HKV, HEAD_DIM, dtype=dtype)
    locations = torch.randperm(num_pages * PAGE, generator=rng, device=CUDA)[:tokens]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    args = (q_w, k_w, 1e-6, positions, cache, ROTARY_DIM)
    want = ref_prologue.norm_rotary_store_kv_reference(q, k, v, *args, want_k, want_v, locations)
    got = kernel(q, k, v, *args, k_cache, v_cache, locations)
    check(f"prologue_q_{tokens}", got, want, dtype)
    check(f"prologue_k_cache_{tokens}", k_cache, want_k, dtype)
    assert torch.equal(v_cache, want_v)
