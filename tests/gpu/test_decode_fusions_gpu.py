"""The batch-1 decode folds at Qwen3.6-35B-A3B's sizes on the GPU: the lm_head's fused launch
storing float32 logits (``out_dtype``) at 248,320 x 2048, the GDN conv step in the input norm +
in_proj launch, and the GDN output norm in the delta-rule step's launch; each against the unfused
launches and the references, eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import gemv_configs
from freetoken.layers.norm import RMSNorm
from gpu_checks import capture_graph, replay

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HIDDEN = 2048
EPS = 1e-6


def _randn(rng, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=rng, device=CUDA) * scale).to(dtype)


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
