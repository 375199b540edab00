"""The fused decode kernels against their torch references at Qwen3.6-35B-A3B's sizes: the Gated
DeltaNet decode chain (16 key / 32 value heads of 128, conv kernel 4) and the attention prologue
(16 query / 2 KV heads of 256, rotary 64, pages of 16). Fresh random inputs, poisoned outputs;
bounds as tests/gpu/test_kernels_real_sizes.py's."""

from __future__ import annotations

import importlib

import pytest
import torch

from freetoken.kernels import attention_prologue as ref_prologue
from freetoken.kernels import gdn_decode as ref_gdn_decode
from freetoken.kernels.rotary import build_rotary_cache

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
HQ, HKV, HEAD_DIM, ROTARY_DIM, PAGE = 16, 2, 256, 64, 16
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CUDA = torch.device("cuda")


def randn(rng, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)


def _deltanet_inputs(rng, dtype, batch, num_slots):
    channels = 2 * HK * DK + HV * DV
    packed = randn(rng, batch, channels + HV * DV + 2 * HV, dtype=dtype)  # the in_proj output
    mixed_qkv = packed[:, :channels]
    z = packed[:, channels : channels + HV * DV].reshape(batch, HV, DV)
    b, a = packed[:, channels + HV * DV :].split([HV, HV], dim=-1)
    weights = (
        randn(rng, channels, CONV_K, dtype=dtype, scale=0.5),  # conv_weight
        randn(rng, HV, dtype=dtype, scale=0.5),  # A_log
        randn(rng, HV, dtype=dtype),  # dt_bias
        (1 + randn(rng, DV, scale=0.2)).to(dtype),  # norm_weight
        1e-6,
    )
    conv_state = randn(rng, num_slots, channels, CONV_K - 1, dtype=dtype)
    recurrent_state = randn(rng, num_slots, HV, DK, DV, scale=0.1)
    return (mixed_qkv, z, a, b), weights, conv_state, recurrent_state


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gated_deltanet_decode(rng, check, dtype, batch, activation):
    kernel = importlib.import_module("freetoken.kernels.triton.gdn_decode").gated_deltanet_decode
    inputs, weights, conv_state, recurrent_state = _deltanet_inputs(rng, dtype, batch, 80)
    slots = torch.randperm(80, generator=rng, device=CUDA)[:batch].int()
    want_conv, want_rec = conv_state.clone(), recurrent_state.clone()
    want = ref_gdn_decode.gated_deltanet_decode_reference(*inputs, *weights, want_conv, want_rec, slots, activation)
    got = kernel(*inputs, *weights, conv_state, recurrent_state, slots, activation)
    check(f"gdn_fused_out_{batch}", got, want, dtype)
    assert torch.equal(conv_state, want_conv)
    check(f"gdn_fused_state_{batch}", recurrent_state, want_rec, torch.float32)


def test_gated_deltanet_decode_padding_rows(rng, check):
    """A graph's padded batch: 5 real rows, 3 on the scratch slot 0, which only slot 0 sees."""
    kernel = importlib.import_module("freetoken.kernels.triton.gdn_decode").gated_deltanet_decode
    inputs, weights, conv_state, recurrent_state = _deltanet_inputs(rng, torch.bfloat16, 8, 20)
    slots = torch.tensor([7, 3, 19, 1, 12, 0, 0, 0], dtype=torch.int32, device=CUDA)
    want_conv, want_rec = conv_state.clone(), recurrent_state.clone()
    real = [t[:5] for t in inputs]
    want = ref_gdn_decode.gated_deltanet_decode_reference(*real, *weights, want_conv, want_rec, slots[:5])
    got = kernel(*inputs, *weights, conv_state, recurrent_state, slots)
    check("gdn_fused_padded_out", got[:5], want, torch.bfloat16)
    assert torch.equal(conv_state[1:], want_conv[1:])
    check("gdn_fused_padded_state", recurrent_state[1:], want_rec[1:], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 777])
def test_norm_rotary_store_kv(rng, check, dtype, tokens):
    kernel = importlib.import_module("freetoken.kernels.triton.attention_prologue").norm_rotary_store_kv
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
