"""The MoE router's fused launch (residual add + RMSNorm + router GEMV, the last program to finish
routing every row: ``kernels.add_rms_norm_gemv_route``) at Qwen3.6-35B-A3B's sizes (264 x 2048
router + shared gate, 256 experts, top 8), and the decode block from its routing
(``kernels.sparse_moe_decode_routed``): against the plain fused launch and the routing kernel, and
several layers of both in a CUDA graph, replayed with new inputs, with programmatic dependent
launch on and off (the gate/up launch reads the routing the router launch's last program wrote).
Also the lm_head's fused launch storing float32 logits (``out_dtype``) at 248,320 x 2048."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.kernels import gemv_configs
from freetoken.kernels.moe_decode import sparse_moe_decode_reference
from freetoken.layers import moe
from freetoken.layers.norm import RMSNorm
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN, EXPERTS, TOP_K, INTER, GATE_ROWS, LAYERS = 2048, 256, 8, 512, 264, 3
EPS = 1e-6


def _randn(rng, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)


def _stable_top_k(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference router (renormalised) with ties to the lower expert id, as the kernels break them."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :TOP_K]
    weights = probs.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, gemv_configs.NORMED_MAX_ROWS])
def test_router_launch_routes_at_real_sizes(rng, check, dtype, rows):
    from freetoken.kernels.triton import _common, moe_decode, normed_gemv

    x, res = (_randn(rng, rows, HIDDEN, dtype=dtype) for _ in range(2))
    nw = _randn(rng, HIDDEN, dtype=dtype, scale=0.2)
    w = _randn(rng, GATE_ROWS, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5)
    logits, normed, summed, top_w, top_i = normed_gemv.add_rms_norm_gemv_route(x, res, nw, EPS, True, w, EXPERTS, TOP_K, True)
    want_out, want_normed, want_summed = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w, True)
    assert torch.equal(logits, want_out) and torch.equal(normed, want_normed) and torch.equal(summed, want_summed)
    want_w, want_i = _stable_top_k(logits[:, :EXPERTS])
    assert torch.equal(top_i, want_i)
    torch.testing.assert_close(top_w, want_w, rtol=1e-5, atol=1e-6)
    route_w, route_i = moe_decode.route(logits, EXPERTS, TOP_K, True)  # the block's own routing launch
    assert torch.equal(top_i, route_i)
    torch.testing.assert_close(top_w, route_w, rtol=1e-6, atol=1e-7)
    torch.cuda.synchronize()
    assert all(int(b.count_nonzero()) == 0 for owned in _common._counter_buffers.values() for b in owned)


def _layer(rng, dtype, rows):
    return dict(
        nw=_randn(rng, HIDDEN, dtype=dtype, scale=0.2),
        gate=_randn(rng, GATE_ROWS, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5),
        w13=_randn(rng, EXPERTS, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5),
        w2=_randn(rng, EXPERTS, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5),
        sgu=_randn(rng, 2 * INTER, HIDDEN, dtype=dtype, scale=HIDDEN**-0.5),
        sd=_randn(rng, HIDDEN, INTER, dtype=dtype, scale=INTER**-0.5),
    )


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, gemv_configs.NORMED_MAX_ROWS])
def test_routed_layers_in_a_cuda_graph(rng, check, pdl, dtype, rows):
    """Three layers of (router launch, two expert launches), the stream carried through, in one
    graph replayed twice with new inputs: each layer against the reference block on that layer's
    normalized rows and logits (so roundings do not compound)."""
    from freetoken.kernels.triton import moe_decode, normed_gemv

    layers = [_layer(rng, dtype, rows) for _ in range(LAYERS)]
    x, res = (_randn(rng, rows, HIDDEN, dtype=dtype) for _ in range(2))
    config = dataclasses.replace(gemv_configs.normed_gemv_config(rows, GATE_ROWS, HIDDEN), pdl=pdl)
    tiles = dataclasses.replace(moe_decode.TILES, pdl=pdl)

    def step() -> list[tuple[torch.Tensor, ...]]:
        hidden, residual, outs = x, res, []
        for p in layers:
            logits, normed, residual, top_w, top_i = normed_gemv.add_rms_norm_gemv_route_tiled(
                hidden, residual, p["nw"], EPS, True, p["gate"], EXPERTS, TOP_K, True, config
            )
            hidden = moe_decode.sparse_moe_decode_routed_tiled(
                normed, logits[:, : EXPERTS + 1], top_w, top_i, p["w13"], p["w2"], p["sgu"], p["sd"], tiles
            )
            outs.append((logits, normed, top_i, hidden))
        return outs

    graph, outs = capture_graph(step)
    for n in range(2):
        x.copy_(_randn(rng, rows, HIDDEN, dtype=dtype))
        res.copy_(_randn(rng, rows, HIDDEN, dtype=dtype))
        replay(graph, (t for layer_outs in outs for t in layer_outs), -1)
        for i, ((logits, normed, top_i, hidden), p) in enumerate(zip(outs, layers)):
            assert torch.equal(top_i, _stable_top_k(logits[:, :EXPERTS])[1]), f"layer {i} replay {n}"
            want = sparse_moe_decode_reference(
                normed, logits[:, : EXPERTS + 1], p["w13"], p["w2"], p["sgu"], p["sd"], TOP_K, True
            )
            check(f"routed_graph_m{rows}_layer{i}_replay{n}", hidden.float(), want.float(), dtype)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_moe_block_takes_the_fused_router_launch(rng, check, monkeypatch, rows):
    """``SparseMoE.forward_normed`` on CUDA: the fused router launch where the norm folds into the
    router GEMV (up to ``NORMED_MAX_ROWS`` rows), the same block as with ``FUSED_ROUTE`` off."""
    from freetoken import kernels

    block = moe.SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, INTER).to(CUDA, torch.bfloat16)
    for p in block.parameters():
        p.data.copy_(_randn(rng, *p.shape, dtype=torch.bfloat16, scale=p.shape[-1] ** -0.5))
    norm = RMSNorm(HIDDEN, EPS, zero_centered=True).to(CUDA, torch.bfloat16)
    norm.weight.data.copy_(_randn(rng, HIDDEN, dtype=torch.bfloat16, scale=0.2))
    x, res = (_randn(rng, rows, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
    calls = []
    fused = kernels.add_rms_norm_gemv_route
    monkeypatch.setattr(kernels, "add_rms_norm_gemv_route", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(moe, "FUSED_ROUTE", True)  # off by default (slower end to end), still kept exact
    got, got_res = block.forward_normed(norm, x, res)
    assert len(calls) == (rows <= gemv_configs.NORMED_MAX_ROWS)
    monkeypatch.setattr(moe, "FUSED_ROUTE", False)
    want, want_res = block.forward_normed(norm, x, res)
    assert len(calls) == (rows <= gemv_configs.NORMED_MAX_ROWS)
    assert torch.equal(got_res, want_res)
    check(f"moe_block_fused_route_m{rows}", got.float(), want.float(), torch.bfloat16)


def test_lm_head_launch_stores_float32_logits(rng):
    """The final norm + lm_head with ``out_dtype=float32``: the bf16 launch's logits, converted."""
    from freetoken.kernels.triton import normed_gemv

    x, res = (_randn(rng, 1, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
    nw = _randn(rng, HIDDEN, dtype=torch.bfloat16, scale=0.2)
    w = _randn(rng, 248320, HIDDEN, dtype=torch.bfloat16, scale=HIDDEN**-0.5)
    got = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w, False, torch.float32)[0]
    want = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w)[0]
    assert got.dtype == torch.float32 and torch.equal(got, want.float())


def _decode_batch(rows: int, slots: torch.Tensor):
    from freetoken.batch import ForwardBatch

    zeros = torch.zeros(rows, dtype=torch.int64, device=CUDA)
    return ForwardBatch(
        input_ids=zeros, positions=zeros, cu_seqlens=torch.arange(rows + 1, dtype=torch.int32, device=CUDA),
        seq_lens=torch.ones(rows, dtype=torch.int32, device=CUDA),
        page_table=torch.zeros(rows, 1, dtype=torch.int32, device=CUDA), kv_locations=zeros, state_slots=slots,
        logits_indices=zeros, num_decodes=rows, max_query_len=1, max_seq_len=16, query_lens=[1] * rows,
    )


@pytest.mark.parametrize("rows", [1, 2, gemv_configs.NORMED_MAX_ROWS])
def test_gdn_layer_conv_in_its_input_launch(rng, check, monkeypatch, rows):
    """A Qwen3.6 GDN layer's decode step with the conv step in the input norm + in_proj launch
    (``FUSED_CONV``) and without: the same output, residual and conv / recurrent states, twice in a
    row (the second step reads the states the first one moved on); replayed from a CUDA graph too."""
    from freetoken import kernels
    from freetoken.layers import gated_deltanet
    from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet

    layer = GatedDeltaNet(DeltaNetSizes(HIDDEN, 16, 32, 128, 128, 4, EPS)).to(CUDA, torch.bfloat16)
    for p in layer.parameters():
        p.data.copy_(_randn(rng, *p.shape, dtype=torch.bfloat16, scale=p.shape[-1] ** -0.5))
    layer.A_log.data.copy_(torch.rand(layer.A_log.shape, generator=rng, device=CUDA).log())
    norm = RMSNorm(HIDDEN, EPS, zero_centered=True).to(CUDA, torch.bfloat16)
    norm.weight.data.copy_(_randn(rng, HIDDEN, dtype=torch.bfloat16, scale=0.2))
    shapes = layer.state_shapes(8, torch.bfloat16)
    conv0 = _randn(rng, *shapes["conv_state"][0], dtype=torch.bfloat16)
    rec0 = torch.randn(shapes["recurrent_state"][0], generator=rng, device=CUDA) * 0.1
    slots = torch.randperm(7, generator=rng, device=CUDA)[:rows].to(torch.int32) + 1
    batch = _decode_batch(rows, slots)
    xs = [(_randn(rng, rows, HIDDEN, dtype=torch.bfloat16), _randn(rng, rows, HIDDEN, dtype=torch.bfloat16))
          for _ in range(2)]
    calls = []
    fused = kernels.add_rms_norm_gemv_conv
    monkeypatch.setattr(kernels, "add_rms_norm_gemv_conv", lambda *a: calls.append(1) or fused(*a))

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(gated_deltanet, "FUSED_CONV", on)
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        outs = []
        for x, res in xs:
            outs.extend(layer.forward_normed(norm, x, res, batch))
        return [*outs, layer.conv_state, layer.recurrent_state]

    got, want = run(True), run(False)
    assert len(calls) == 2
    for i, (g, w) in enumerate(zip(got, want)):
        check(f"gdn_conv_fused_m{rows}_{i}", g.float(), w.float(), torch.bfloat16)
    # In a graph: the fused step replayed from the start states gives the eager fused step's.
    monkeypatch.setattr(gated_deltanet, "FUSED_CONV", True)
    layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
    x, res = xs[0]
    graph, (out, summed) = capture_graph(lambda: layer.forward_normed(norm, x, res, batch))
    layer.conv_state.copy_(conv0)
    layer.recurrent_state.copy_(rec0)
    replay(graph)
    assert torch.equal(out, got[0]) and torch.equal(summed, got[1])


def _gdn_step_inputs(rng, dtype, rows):
    """q|k|v views of one conv output and z|b|a views of one in_proj output at Qwen3.6's GDN sizes
    (16 key heads, 32 value heads, 128 x 128), as the layer passes them."""
    hk, hv, d = 16, 32, 128
    conv = _randn(rng, rows, 2 * hk * d + hv * d, dtype=dtype)
    q, k = (conv[:, i * hk * d : (i + 1) * hk * d].reshape(rows, hk, d) for i in range(2))
    v = conv[:, 2 * hk * d :].reshape(rows, hv, d)
    projected = _randn(rng, rows, hv * d + 2 * hv, dtype=dtype)
    z = projected[:, : hv * d].reshape(rows, hv, d)
    b, a = projected[:, hv * d : hv * d + hv], projected[:, hv * d + hv :]
    A_log = torch.rand(hv, generator=rng, device=CUDA).log()
    dt_bias = _randn(rng, hv, dtype=dtype)
    return (q, k, v, a, b, A_log, dt_bias), z


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gdn_decode_with_the_output_norm_at_real_sizes(rng, check, dtype, rows, activation):
    """``gated_delta_rule_decode_gated_norm`` (the last of a head's programs normalizes its row) against
    the unfused Triton chain (the step, then ``gated_rms_norm``) and the composed references: the
    output and the moved state, slots out of order."""
    from freetoken.kernels import gdn_decode as ref
    from freetoken.kernels.triton import gdn_decode, norm

    gating, z = _gdn_step_inputs(rng, dtype, rows)
    nw = _randn(rng, 128, dtype=dtype, scale=0.2) + 1
    state = torch.randn(40, 32, 128, 128, generator=rng, device=CUDA) * 0.1
    slots = torch.randperm(40, generator=rng, device=CUDA)[:rows].to(torch.int32)
    chain_state, ref_state = state.clone(), state.clone()
    got = gdn_decode.gated_delta_rule_decode_gated_norm(*gating, state, slots, z, nw, EPS, activation)
    chain = norm.gated_rms_norm(gdn_decode.gated_delta_rule_decode_gated(*gating, chain_state, slots), z, nw, EPS, activation)
    want = ref.gated_delta_rule_decode_gated_norm_reference(*gating, ref_state, slots, z, nw, EPS, activation)
    check(f"gdn_decode_norm_vs_chain_m{rows}_{activation}", got.float(), chain.float(), dtype)
    check(f"gdn_decode_norm_state_vs_chain_m{rows}", state, chain_state, torch.float32)
    check(f"gdn_decode_norm_vs_reference_m{rows}_{activation}", got.float(), want.float(), dtype)
    check(f"gdn_decode_norm_state_vs_reference_m{rows}", state, ref_state, dtype)


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_gdn_layer_output_norm_in_its_decode_launch(rng, check, monkeypatch, rows):
    """A Qwen3.6 GDN layer's decode step with the output norm in the delta-rule launch
    (``FUSED_DECODE_NORM``, its row limit lifted to ``rows``) and without: the same output, residual
    and states, two steps in a row;
    then three layers' worth of steps captured in one CUDA graph (programmatic dependent launch as
    the engine has it) and replayed with the outputs poisoned give the eager outputs."""
    from freetoken import kernels
    from freetoken.layers import gated_deltanet
    from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet

    layer = GatedDeltaNet(DeltaNetSizes(HIDDEN, 16, 32, 128, 128, 4, EPS)).to(CUDA, torch.bfloat16)
    for p in layer.parameters():
        p.data.copy_(_randn(rng, *p.shape, dtype=torch.bfloat16, scale=p.shape[-1] ** -0.5))
    layer.A_log.data.copy_(torch.rand(layer.A_log.shape, generator=rng, device=CUDA).log())
    layer.norm_weight.data.copy_(_randn(rng, 128, dtype=torch.bfloat16, scale=0.2) + 1)
    norm = RMSNorm(HIDDEN, EPS, zero_centered=True).to(CUDA, torch.bfloat16)
    norm.weight.data.copy_(_randn(rng, HIDDEN, dtype=torch.bfloat16, scale=0.2))
    shapes = layer.state_shapes(rows + 6, torch.bfloat16)
    conv0 = _randn(rng, *shapes["conv_state"][0], dtype=torch.bfloat16)
    rec0 = torch.randn(shapes["recurrent_state"][0], generator=rng, device=CUDA) * 0.1
    slots = torch.randperm(rows + 5, generator=rng, device=CUDA)[:rows].to(torch.int32) + 1
    batch = _decode_batch(rows, slots)
    xs = [(_randn(rng, rows, HIDDEN, dtype=torch.bfloat16), _randn(rng, rows, HIDDEN, dtype=torch.bfloat16))
          for _ in range(3)]
    calls = []
    fused = kernels.gated_delta_rule_decode_gated_norm
    monkeypatch.setattr(kernels, "gated_delta_rule_decode_gated_norm", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(gated_deltanet, "DECODE_NORM_MAX_ROWS", rows)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(gated_deltanet, "FUSED_DECODE_NORM", on)
        layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
        outs = [layer.forward_normed(norm, x, res, batch)[0] for x, res in xs]
        return [*outs, layer.conv_state, layer.recurrent_state]

    got, want = run(True), run(False)
    assert len(calls) == len(xs)
    for i, (g, w) in enumerate(zip(got, want)):
        check(f"gdn_decode_norm_layer_m{rows}_{i}", g.float(), w.float(), torch.bfloat16 if i < len(xs) else torch.float32)
    monkeypatch.setattr(gated_deltanet, "FUSED_DECODE_NORM", True)
    layer.conv_state, layer.recurrent_state = conv0.clone(), rec0.clone()
    graph, outs = capture_graph(lambda: [layer.forward_normed(norm, x, res, batch)[0] for x, res in xs])
    layer.conv_state.copy_(conv0)
    layer.recurrent_state.copy_(rec0)
    replay(graph, outs)
    for i, out in enumerate(outs):
        assert torch.equal(out, got[i]), f"step {i} replayed"
    assert torch.equal(layer.recurrent_state, got[-1])
