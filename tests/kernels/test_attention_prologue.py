from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import attention_prologue as ref
from freetoken.kernels.rotary import build_rotary_cache


def _inputs(rng, dtype, tokens, hq, hkv, head_dim, rotary_dim, pages, page_size):
    """q, k and v as the layer passes them: strided views of one packed projection output."""
    packed = torch.randn(tokens, hq * 2 * head_dim + 2 * hkv * head_dim + 3, generator=rng).to(dtype).to(DEVICE)
    q = packed[:, : hq * 2 * head_dim].view(tokens, hq, 2 * head_dim)[..., :head_dim]
    k = packed[:, hq * 2 * head_dim : (hq * 2 + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = packed[:, (hq * 2 + hkv) * head_dim : -3].view(tokens, hkv, head_dim)
    q_w = (0.3 * torch.randn(head_dim, generator=rng)).to(dtype).to(DEVICE)
    k_w = (0.3 * torch.randn(head_dim, generator=rng)).to(dtype).to(DEVICE)
    cache = build_rotary_cache(rotary_dim, 128, 10000.0, DEVICE)
    positions = torch.randint(0, 128, (tokens,), generator=rng).to(DEVICE)
    k_cache = torch.randn(pages, page_size, hkv, head_dim, generator=rng).to(dtype).to(DEVICE)
    v_cache = torch.randn(pages, page_size, hkv, head_dim, generator=rng).to(dtype).to(DEVICE)
    kv_locations = torch.randperm(pages * page_size, generator=rng)[:tokens].to(DEVICE)
    return q, k, v, q_w, k_w, positions, cache, k_cache, v_cache, kv_locations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "hq", "hkv", "head_dim", "rotary_dim"),
    [(7, 5, 2, 24, 12), (3, 4, 4, 16, 16), (70, 3, 1, 20, 6)],  # partial, full rotary, two token blocks
)
def test_attention_prologue(rng, dtype, tokens, hq, hkv, head_dim, rotary_dim):
    from freetoken.kernels.triton.attention_prologue import norm_rotary_store_kv

    q, k, v, q_w, k_w, positions, cache, k_cache, v_cache, locs = _inputs(
        rng, dtype, tokens, hq, hkv, head_dim, rotary_dim, pages=20, page_size=4
    )
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = ref.norm_rotary_store_kv_reference(q, k, v, q_w, k_w, 1e-6, positions, cache, rotary_dim, want_k, want_v, locs)
    got = norm_rotary_store_kv(q, k, v, q_w, k_w, 1e-6, positions, cache, rotary_dim, k_cache, v_cache, locs)
    assert_close(got, want)
    assert_close(k_cache, want_k)
    assert torch.equal(v_cache, want_v)  # copies


def test_attention_prologue_rejects_mismatched_shapes():
    from freetoken.kernels.triton.attention_prologue import norm_rotary_store_kv

    q, k, v = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)
    w, cache = torch.zeros(16), torch.zeros(32, 8)
    k_cache = v_cache = torch.zeros(3, 4, 2, 16)
    positions = locs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="k_norm_weight"):
        norm_rotary_store_kv(q, k, v, w, torch.zeros(8), 1e-6, positions, cache, 8, k_cache, v_cache, locs)
    with pytest.raises(ValueError, match="rotary_dim"):
        norm_rotary_store_kv(q, k, v, w, w, 1e-6, positions, cache, 6, k_cache, v_cache, locs)


def test_attention_prologue_padding_rows_touch_only_the_scratch_page(rng):
    """Padded graph rows store at location 0 (the scratch page) at position 0: the real rows'
    queries and cache entries are those of a batch without them, every other location untouched."""
    from freetoken.kernels.triton.attention_prologue import norm_rotary_store_kv

    real, padded, page_size = 3, 4, 4
    q, k, v, q_w, k_w, positions, cache, k_cache, v_cache, locs = _inputs(
        rng, torch.float32, real + padded, 4, 2, 16, 8, pages=6, page_size=page_size
    )
    locs = torch.cat([torch.randperm(5 * page_size, generator=rng)[:real].to(DEVICE) + page_size,
                      torch.zeros(padded, dtype=torch.int64, device=DEVICE)])
    positions[real:] = 0
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = ref.norm_rotary_store_kv_reference(
        q[:real], k[:real], v[:real], q_w, k_w, 1e-6, positions[:real], cache, 8, want_k, want_v, locs[:real]
    )
    got = norm_rotary_store_kv(q, k, v, q_w, k_w, 1e-6, positions, cache, 8, k_cache, v_cache, locs)
    assert_close(got[:real], want)
    assert_close(k_cache[1:], want_k[1:])
    assert torch.equal(v_cache[1:], want_v[1:])


def test_attention_prologue_decode_batch_stays_inside_the_cache(rng):
    """A batch-8 decode step at Qwen3.6's head sizes (16 query / 2 KV heads of 256, rotary 64,
    pages of 16) with the last cache location among its stores: every store lands inside the
    cache, the page past its end (a canary in the same allocation) untouched."""
    from freetoken.kernels.triton.attention_prologue import norm_rotary_store_kv

    tokens, pages, page_size = 8, 3, 16
    q, k, v, q_w, k_w, positions, cache, _, _, _ = _inputs(
        rng, torch.bfloat16, tokens, 16, 2, 256, 64, pages=1, page_size=page_size
    )
    k_buffer = torch.randn(pages + 1, page_size, 2, 256, generator=rng).to(torch.bfloat16).to(DEVICE)
    v_buffer = torch.randn(pages + 1, page_size, 2, 256, generator=rng).to(torch.bfloat16).to(DEVICE)
    k_cache, v_cache = k_buffer[:pages], v_buffer[:pages]
    locs = torch.randperm(pages * page_size - 1, generator=rng)[: tokens - 1].to(DEVICE)
    locs = torch.cat([locs, torch.tensor([pages * page_size - 1], device=DEVICE)])
    want_k, want_v = k_buffer.clone(), v_buffer.clone()
    want = ref.norm_rotary_store_kv_reference(
        q, k, v, q_w, k_w, 1e-6, positions, cache, 64, want_k[:pages], want_v[:pages], locs
    )
    got = norm_rotary_store_kv(q, k, v, q_w, k_w, 1e-6, positions, cache, 64, k_cache, v_cache, locs)
    assert_close(got, want)
    assert_close(k_buffer, want_k)
    assert torch.equal(v_buffer, want_v)
