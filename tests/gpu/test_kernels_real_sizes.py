"""Each Triton kernel against its torch reference at Qwen3.5-35B-A3B's sizes: hidden 2048, 16 query /
2 KV heads of 256 (partial rotary 64), GDN 16 key / 32 value heads of 128 with conv kernel 4,
256 experts top-8 of intermediate 512, vocabulary 248320. Fresh random inputs, poisoned outputs.

Bounds (relative L2, ``kernel_checks.REL_TOL``): 1e-5 in float32 (exact dot products, other
summation order), 1e-2 in bf16 (bf16 operands and roundings; TF32 inside the GDN kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels import attention as ref_attention
from freetoken.kernels import conv1d as ref_conv
from freetoken.kernels import gated_delta_rule as ref_gdn
from freetoken.kernels import gdn_decode as ref_gdn_decode
from freetoken.kernels import moe as ref_moe
from freetoken.kernels import moe_decode as ref_moe_decode
from freetoken.kernels import norm as ref_norm
from freetoken.kernels import rotary as ref_rotary
from freetoken.kernels import sampling as ref_sampling
from gpu_checks import CUDA, randn, triton_module

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, HQ, HKV, HEAD_DIM, ROTARY_DIM = 2048, 16, 2, 256, 64
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
EXPERTS, TOP_K, INTER = 256, 8, 512
VOCAB = 248320


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms(rng, check, dtype):
    norm = triton_module("norm")
    x, res = randn(rng, 517, HIDDEN, dtype=dtype), randn(rng, 517, HIDDEN, dtype=dtype)
    w = randn(rng, HIDDEN, dtype=dtype, scale=0.2)
    check("rms_norm", norm.rms_norm(x, w, 1e-6, True), ref_norm.rms_norm_reference(x, w, 1e-6, True), dtype)
    got, got_sum = norm.add_rms_norm(x, res, w, 1e-6, True)
    want, want_sum = ref_norm.add_rms_norm_reference(x, res, w, 1e-6, True)
    check("add_rms_norm", got, want, dtype)
    assert torch.equal(got_sum, want_sum)
    q = randn(rng, 301, HQ, 2 * HEAD_DIM, dtype=dtype)[..., :HEAD_DIM]
    wq = randn(rng, HEAD_DIM, dtype=dtype, scale=0.2)
    check("q_norm", norm.rms_norm(q, wq, 1e-6, True), ref_norm.rms_norm_reference(q, wq, 1e-6, True), dtype)
    core = randn(rng, 301, HV, DV, dtype=dtype)
    z = randn(rng, 301, 2 * HV * DV + 64, dtype=dtype)[:, HV * DV : 2 * HV * DV].reshape(301, HV, DV)
    wg = (1 + randn(rng, DV, scale=0.2)).to(dtype)
    check("gated_rms_norm", norm.gated_rms_norm(core, z, wg, 1e-6), ref_norm.gated_rms_norm_reference(core, z, wg, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(rng, check, dtype):
    cache = ref_rotary.build_rotary_cache(ROTARY_DIM, 32768, 1e7, CUDA)
    t = 777
    q = randn(rng, t, HQ, 2 * HEAD_DIM, dtype=dtype)[..., :HEAD_DIM]
    k = randn(rng, t, HKV, HEAD_DIM, dtype=dtype)
    positions = torch.randint(0, 32768, (t,), generator=rng, device=CUDA)
    got = triton_module("rotary").apply_rotary(q, k, positions, cache, ROTARY_DIM)
    want = ref_rotary.apply_rotary_reference(q, k, positions, cache, ROTARY_DIM)
    check("rotary_q", got[0], want[0], dtype)
    check("rotary_k", got[1], want[1], dtype)


def _paged_layout(rng, context_lens, query_lens, page_size, num_pages):
    perm = torch.randperm(num_pages - 1, generator=rng, device=CUDA) + 1
    pages = [-(-c // page_size) for c in context_lens]
    table = torch.zeros(len(context_lens), max(pages), dtype=torch.int32, device=CUDA)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used : used + n].int()
        used += n
    cu = torch.tensor([0] + query_lens, device=CUDA).cumsum(0).int()
    return table, cu, torch.tensor(context_lens, dtype=torch.int32, device=CUDA)


ATTENTION_CASES = {
    "decode_batch": ([int(x) for x in torch.randint(1, 8000, (48,), generator=torch.Generator().manual_seed(0))], [1] * 48),
    "decode_one_long": ([60000], [1]),
    "mixed": ([3000, 17, 900, 1500, 333], [1, 1, 700, 333, 333]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention(rng, check, dtype, case):
    attention = triton_module("attention")
    context_lens, query_lens = ATTENTION_CASES[case]
    page_size = 16
    num_pages = sum(-(-c // page_size) for c in context_lens) + 8
    table, cu, seq_lens = _paged_layout(rng, context_lens, query_lens, page_size, num_pages)
    t = sum(query_lens)
    k_cache = randn(rng, num_pages, page_size, HKV, HEAD_DIM, dtype=dtype)
    v_cache = randn(rng, num_pages, page_size, HKV, HEAD_DIM, dtype=dtype)
    # The newest tokens go through store_kv, as in the layer.
    k_new, v_new = randn(rng, t, HKV, HEAD_DIM, dtype=dtype), randn(rng, t, HKV, HEAD_DIM, dtype=dtype)
    slots = []
    for b, (c, n) in enumerate(zip(context_lens, query_lens)):
        for p in range(c - n, c):
            slots.append(int(table[b, p // page_size]) * page_size + p % page_size)
    slots = torch.tensor(slots, device=CUDA)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref_attention.store_kv_reference(k_new, v_new, want_k, want_v, slots)
    attention.store_kv(k_new, v_new, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    q_gate = randn(rng, t, HQ, 2 * HEAD_DIM, dtype=dtype)
    q, gate = q_gate[..., :HEAD_DIM], q_gate[..., HEAD_DIM:]
    args = (q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM**-0.5, max(query_lens))
    got = attention.paged_attention(*args, gate=gate)
    check(f"paged_attention_{case}", got, ref_attention.paged_attention_reference(*args, gate=gate), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d(rng, check, dtype):
    conv1d = triton_module("conv1d")
    channels = 2 * HK * DK + HV * DV
    lens = [1000, 3, 517]
    packed = randn(rng, sum(lens), channels + HV * DV + 2 * HV, dtype=dtype)
    x = packed[:, :channels]  # mixed_qkv: a slice of the packed projection
    weight = randn(rng, channels, CONV_K, dtype=dtype, scale=0.5)
    state = randn(rng, 70, channels, CONV_K - 1, dtype=dtype)
    slots = torch.tensor([5, 66, 12], dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0] + lens, device=CUDA).cumsum(0).int()
    want_state = state.clone()
    want = ref_conv.causal_conv1d_prefill_reference(x, weight, want_state, slots, cu)
    check("conv1d_prefill", conv1d.causal_conv1d_prefill(x, weight, state, slots, cu), want, dtype)
    assert torch.equal(state, want_state)
    slots = torch.randperm(70, generator=rng, device=CUDA)[:64].int()
    want_state = state.clone()
    want = ref_conv.causal_conv1d_decode_reference(x[:64], weight, want_state, slots)
    check("conv1d_decode", conv1d.causal_conv1d_decode(x[:64], weight, state, slots), want, dtype)
    assert torch.equal(state, want_state)


def _gdn_inputs(rng, dtype, tokens, slots):
    conv = randn(rng, tokens, 2 * HK * DK + HV * DV, dtype=dtype)
    q = conv[:, : HK * DK].reshape(tokens, HK, DK)
    k = conv[:, HK * DK : 2 * HK * DK].reshape(tokens, HK, DK)
    v = conv[:, 2 * HK * DK :].reshape(tokens, HV, DV)
    g = -F.softplus(randn(rng, tokens, HV)) * 0.3
    beta = torch.rand(tokens, HV, generator=rng, device=CUDA).to(dtype)
    state = randn(rng, slots, HV, DK, DV, scale=0.1)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_rule(rng, check, dtype):
    gdn = triton_module("gated_delta_rule")
    lens = [777, 1, 64, 300]
    q, k, v, g, beta, state = _gdn_inputs(rng, dtype, sum(lens), 80)
    slots = torch.tensor([3, 77, 40, 9], dtype=torch.int32, device=CUDA)
    cu = torch.tensor([0] + lens, device=CUDA).cumsum(0).int()
    want_state = state.clone()
    want = ref_gdn.gated_delta_rule_prefill_reference(q, k, v, g, beta, want_state, slots, cu)
    got = gdn.gated_delta_rule_prefill(q, k, v, g, beta, state, slots, cu)
    check("gdn_prefill_out", got, want, dtype)
    check("gdn_prefill_state", state, want_state, dtype)
    q, k, v, g, beta, _ = _gdn_inputs(rng, dtype, 64, 1)
    slots = torch.randperm(80, generator=rng, device=CUDA)[:64].int()
    want_state = state.clone()
    want = ref_gdn.gated_delta_rule_decode_reference(q, k, v, g, beta, want_state, slots)
    check("gdn_decode_out", gdn.gated_delta_rule_decode(q, k, v, g, beta, state, slots), want, dtype)
    check("gdn_decode_state", state, want_state, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gated_delta_rule_decode_gated(rng, check, dtype, batch):
    gdn = triton_module("gdn_decode")
    q, k, v, _, _, state = _gdn_inputs(rng, dtype, batch, 80)
    a, b = randn(rng, batch, HV, dtype=dtype), randn(rng, batch, HV, dtype=dtype)
    A_log, dt_bias = randn(rng, HV, dtype=dtype, scale=0.5), randn(rng, HV, dtype=dtype)
    slots = torch.randperm(80, generator=rng, device=CUDA)[:batch].int()
    want_state = state.clone()
    want = ref_gdn_decode.gated_delta_rule_decode_gated_reference(q, k, v, a, b, A_log, dt_bias, want_state, slots)
    got = gdn.gated_delta_rule_decode_gated(q, k, v, a, b, A_log, dt_bias, state, slots)
    check(f"gdn_decode_gated_out_{batch}", got, want, dtype)
    check(f"gdn_decode_gated_state_{batch}", state, want_state, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8])
def test_sparse_moe_decode(rng, check, dtype, tokens):
    moe_decode = triton_module("moe_decode")
    x = randn(rng, tokens, HIDDEN, dtype=dtype)
    distinct = torch.stack([torch.randperm(EXPERTS, generator=rng, device=CUDA) for _ in range(tokens)])
    gate_logits = torch.cat([(distinct - 128) / 32.0, randn(rng, tokens, 1)], dim=1).to(dtype)
    w13 = randn(rng, EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    w2 = randn(rng, EXPERTS, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5)
    shared_gate_up = randn(rng, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    shared_down = randn(rng, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5)
    args = (x, gate_logits, w13, w2, shared_gate_up, shared_down, TOP_K, True)
    want = ref_moe_decode.sparse_moe_decode_reference(*args)
    check(f"sparse_moe_decode_{tokens}", moe_decode.sparse_moe_decode(*args), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_routing_and_sort(rng, check, dtype):
    moe = triton_module("moe")
    t = 1000
    # Distinct logits in every row, exact in bf16 (torch.topk leaves the order of ties unspecified).
    distinct = torch.stack([torch.randperm(EXPERTS, generator=rng, device=CUDA) for _ in range(t)])
    packed = torch.cat([(distinct - 128) / 32.0, torch.zeros(t, 1, device=CUDA)], dim=1).to(dtype)
    logits = packed[:, :EXPERTS]  # the router part of the router + shared-gate GEMM
    weights, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    want_w, want_ids = ref_moe.moe_topk_softmax_reference(logits, TOP_K, True)
    assert torch.equal(ids, want_ids)
    check("moe_topk_softmax", weights, want_w, dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=rng, device=CUDA)[:TOP_K] for _ in range(4096)]).int()
    order, offsets = moe.moe_sort_tokens(ids, EXPERTS)
    want_order, want_offsets = ref_moe.moe_sort_tokens_reference(ids, EXPERTS)
    assert torch.equal(offsets, want_offsets) and torch.equal(order, want_order)


# 1 to 256 tokens of top-8: the one-program sort; 257 and 1000: the three-launch sort
@pytest.mark.parametrize("tokens", [1, 64, 256, 257, 1000])
def test_moe_sort_tokens_decode_sizes(rng, tokens):
    """The sort of the top-k kernel's ids (ties included: random bf16 logits tie) equals the
    reference's, also replayed from a graph."""
    moe = triton_module("moe")
    logits = randn(rng, tokens, EXPERTS + 1, dtype=torch.bfloat16)[:, :EXPERTS]
    _, ids = moe.moe_topk_softmax(logits, TOP_K, True)
    got = moe.moe_sort_tokens(ids, EXPERTS)
    want = ref_moe.moe_sort_tokens_reference(ids, EXPERTS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.moe_sort_tokens(ids, EXPERTS)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(r, g) for r, g in zip(replayed, got))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [64, 2048])
def test_fused_experts(rng, check, dtype, tokens):
    moe = triton_module("moe")
    x = randn(rng, tokens, HIDDEN, dtype=dtype)
    w13 = randn(rng, EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    w2 = randn(rng, EXPERTS, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5)
    weights, ids = ref_moe.moe_topk_softmax_reference(randn(rng, tokens, EXPERTS, dtype=dtype), TOP_K, True)
    got = moe.fused_experts(x, w13, w2, weights, ids)
    check(f"fused_experts_{tokens}", got, ref_moe.fused_experts_reference(x, w13, w2, weights, ids), dtype)
    shared = randn(rng, tokens, 2 * INTER, dtype=dtype)
    check("silu_and_mul", moe.silu_and_mul(shared), ref_moe.silu_and_mul_reference(shared), dtype)
    gate = randn(rng, tokens, EXPERTS + 1, dtype=dtype)[:, EXPERTS:]
    check(
        "shared_expert_combine",
        moe.shared_expert_combine(got, x, gate),
        ref_moe.shared_expert_combine_reference(got, x, gate),
        dtype,
    )


def test_sample_tokens_full_vocabulary(rng):
    """Greedy, temperature, top-k, top-p, min-p and all together over Qwen's 248320 tokens: the same
    tokens as the reference. top-p / min-p sit between two candidates' values (see the CPU test)."""
    sampling = triton_module("sampling")
    batch, temperature_ = 8, 0.7
    logits = randn(rng, batch, VOCAB, scale=4.0)
    temperature = torch.full((batch,), temperature_, device=CUDA)
    temperature[0] = 0
    top_k = torch.zeros(batch, dtype=torch.int32, device=CUDA)
    top_p, min_p = torch.ones(batch, device=CUDA), torch.zeros(batch, device=CUDA)
    probs = torch.softmax(logits / temperature_, -1).sort(-1, descending=True).values
    mass_before = probs.cumsum(-1) - probs

    def between(values, rank):
        return float((values[rank] + values[rank + 1]) / 2)

    top_k[2] = 50
    top_p[3] = between(mass_before[3], 200)
    min_p[4] = between(probs[4] / probs[4, 0], 30)
    top_k[5], top_p[5], min_p[5] = 100, between(mass_before[5], 60), between(probs[5] / probs[5, 0], 80)
    top_k[6] = 1
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=rng, device=CUDA)
    mismatches = 0
    for step in range(8):
        steps = torch.full((batch,), step, dtype=torch.int64, device=CUDA)
        args = (logits, temperature, top_k, top_p, min_p, seeds, steps)
        got = sampling.sample_tokens(*args)
        expected = ref_sampling.sample_tokens_reference(*args)
        for row in (got != expected).nonzero().flatten().tolist():
            # Two implementations of the softmax may round the race of two near-equal candidates
            # apart; over 248320 tokens that happens now and then. Anything else is a bug.
            race = torch.softmax(logits[row] / temperature_, -1) / -torch.log(
                ref_sampling.uniform_noise(seeds[row : row + 1], steps[row : row + 1], VOCAB)[0]
            )
            a, b = race[got[row]].item(), race[expected[row]].item()
            assert abs(a - b) <= 1e-5 * max(a, b), f"row {row}: {got[row]} vs {expected[row]}, race {a} vs {b}"
            mismatches += 1
    assert mismatches <= 1
