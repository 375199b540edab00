"""The NVFP4 prefill GEMMs at small odd sizes: the grouped W4A16 kernels in every tile shape the
tuner may pick (ragged K, several row tiles an expert, row-tile groups), the dequantize-then-bf16
path in expert groups, the dense linear's dequantize-then-cuBLAS path, and the config table."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import moe as moe_ref
from freetoken.kernels import nvfp4 as ref
from expert_spans import in_span
from kernel_checks import DEVICE, assert_close
from test_nvfp4_kernels import assert_close_to_float32, random_nvfp4


def _triton():
    from freetoken.kernels.triton import nvfp4

    return nvfp4


def _configs():
    from freetoken.kernels.triton import nvfp4_configs

    return nvfp4_configs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40, 48), (70, 272)])
def test_dequantize_nvfp4_is_the_reference_bit_for_bit(rng, dtype, shape):
    """The one-launch dequantization (rows and columns not multiples of its tile) rounds once, as the
    reference: ``e2m1 · e4m3`` exact, times the row scale in float32."""
    w = random_nvfp4(rng, *shape)
    assert torch.equal(_triton().dequantize_nvfp4(*w, dtype), ref.dequantize_nvfp4(*w, dtype))


def _moe_inputs(rng, dtype, tokens, e=7, k=3, hidden=80, inter=48):
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    w13 = random_nvfp4(rng, e, 2 * inter, hidden)
    w2 = random_nvfp4(rng, e, hidden, inter)
    logits = torch.randn(tokens, e, generator=rng).to(dtype).to(DEVICE)
    weights, ids = moe_ref.moe_topk_softmax_reference(logits, k, True)
    return x, w13, w2, weights, ids


def _config(*fields):
    return None if fields == (None,) else _configs().Nvfp4GemmConfig(*fields)


# (gate/up, down) configurations: block_m, block_n, block_k, group_m, warps, stages, swap_ab,
# fold_bias, split. hidden 80 and inter 48: K steps of 64 leave a ragged last step, 16 divide both (no
# column masks); 16-row tiles give several tiles an expert; swap_ab the transposed product;
# fold_bias the tiles decoded short of 2^8, the row scales taking it back; split the even and odd
# columns decoded and multiplied apart; None: dequantize and run the bf16 GEMM.
CONFIG_CASES = [
    ((16, 32, 64, 1, 4, 1), (16, 16, 64, 1, 4, 1)),
    ((32, 64, 16, 4, 4, 1, True), (32, 64, 16, 8, 4, 1, True)),
    ((64, 16, 64, 8, 4, 1), (16, 64, 16, 2, 4, 1, True)),
    ((16, 64, 64, 1, 4, 1, True), (64, 16, 64, 4, 4, 1)),
    ((None,), (None,)),
    ((16, 64, 64, 8, 4, 1, True), (None,)),
    ((16, 64, 64, 1, 4, 1, True, True), (32, 64, 16, 8, 4, 1, True, True)),
    ((32, 16, 64, 4, 4, 1, False, True), (16, 16, 64, 1, 4, 1, False, True)),
    ((32, 64, 64, 4, 4, 1, True, False, True), (16, 64, 32, 8, 4, 1, True, True, True)),
    ((16, 32, 32, 1, 4, 1, False, False, True), (None,)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("configs", CONFIG_CASES,
                         ids=lambda c: "-".join("dequant" if f == (None,) else "x".join(map(str, f[:3])) + ("s" if f[6:7] == (True,) else "")
                                           + ("f" if f[7:8] == (True,) else "") + ("p" if f[8:] == (True,) else "")
                                           for f in c))
def test_fused_experts_nvfp4_in_every_config(rng, dtype, configs, monkeypatch):
    """Each tile shape and the dequantize path (two experts a group: four groups for seven experts)
    give the float32 reference's result; 37 tokens of top-3 over 7 experts: ~16 pairs an expert."""
    monkeypatch.setattr(_configs(), "DEQUANT_GROUP_BYTES", 2 * 2 * 48 * 80 * torch.tensor([], dtype=dtype).element_size())
    x, w13, w2, weights, ids = _moe_inputs(rng, dtype, 37)
    got = _triton().fused_experts_nvfp4_tiled(x, *w13, *w2, weights, ids, tuple(_config(*c) for c in configs))
    assert_close_to_float32(got, ref.fused_experts_nvfp4_reference, x, *w13, *w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("configs", [CONFIG_CASES[0], CONFIG_CASES[4], CONFIG_CASES[6], CONFIG_CASES[8]],
                         ids=["tiles", "dequant", "folded", "split"])
def test_fused_experts_nvfp4_reads_span_views_in_place(rng, dtype, configs, monkeypatch):
    """The experts as an offloaded layer's cache holds them (``experts.span``: the six parts strided
    views of one byte span an expert): the kernels take the expert strides, copy nothing, and give
    the contiguous experts' result bit for bit (the reference's too, as close as there)."""
    monkeypatch.setattr(_configs(), "DEQUANT_GROUP_BYTES", 2 * 2 * 48 * 80 * torch.tensor([], dtype=dtype).element_size())
    x, w13, w2, weights, ids = _moe_inputs(rng, dtype, 37)
    spans = in_span([*w13, *w2])
    assert all(_triton().expert_major(part) is part for part in spans)
    tiles = tuple(_config(*c) for c in configs)
    got = _triton().fused_experts_nvfp4_tiled(x, *spans, weights, ids, tiles)
    assert torch.equal(got, _triton().fused_experts_nvfp4_tiled(x, *w13, *w2, weights, ids, tiles))
    assert torch.equal(ref.fused_experts_nvfp4_reference(x, *spans, weights, ids),
                       ref.fused_experts_nvfp4_reference(x, *w13, *w2, weights, ids))
    assert_close_to_float32(got, ref.fused_experts_nvfp4_reference, x, *w13, *w2, weights, ids)


def _slotted_inputs(rng, rows, e=7, k=2, tokens=29, hidden=80, inter=48):
    """Experts in an expert cache of ``rows`` slots (span views, other slots holding other experts'
    values) with their ``slots [e]`` (-1 for the experts no token routes to), the routed ids, and
    the same experts contiguous (``dense [e, ...]``: expert ``j`` at row ``j``, the unrouted ones
    zero): ``(x, spans, slots, dense, weights, ids)``."""
    routed = min(rows, 4)  # the experts the tokens route to
    x = torch.randn(tokens, hidden, generator=rng).to(torch.bfloat16).to(DEVICE)
    cache = [*random_nvfp4(rng, rows, 2 * inter, hidden), *random_nvfp4(rng, rows, hidden, inter)]
    experts = torch.randperm(e, generator=rng)[:routed]
    slots = torch.full((e,), -1, dtype=torch.int32)
    slots[experts] = torch.randperm(rows, generator=rng)[:routed].int()
    logits = torch.randn(tokens, routed, generator=rng).to(torch.bfloat16).to(DEVICE)
    weights, local = moe_ref.moe_topk_softmax_reference(logits, k, True)
    ids = experts.to(DEVICE)[local.long()].int()
    dense = []
    for part in cache:
        rows_of = torch.zeros((e, *part.shape[1:]), dtype=part.dtype, device=DEVICE)
        rows_of[experts.to(DEVICE)] = part[slots.long()[experts].to(DEVICE)]
        dense.append(rows_of)
    return x, in_span(cache), slots.to(DEVICE), dense, weights, ids


@pytest.mark.parametrize("configs", [CONFIG_CASES[0], CONFIG_CASES[4], CONFIG_CASES[6], CONFIG_CASES[8]],
                         ids=["tiles", "dequant", "folded", "split"])
@pytest.mark.parametrize("rows", [11, 4])  # an expert cache larger and smaller than the layer's experts
def test_fused_experts_nvfp4_expert_slots(rng, configs, rows, monkeypatch):
    """``expert_slots``: the kernels (each tile variant, and the dequantize path two experts a
    group) read each expert's parts in its cache slot and give the contiguous experts' result bit
    for bit, as the reference does its own; the kernels as close to the reference as ever."""
    monkeypatch.setattr(_configs(), "DEQUANT_GROUP_BYTES", 2 * 2 * 48 * 80 * 2)
    x, spans, slots, dense, weights, ids = _slotted_inputs(rng, rows)
    tiles = tuple(_config(*c) for c in configs)
    want = _triton().fused_experts_nvfp4_tiled(x, *dense, weights, ids, tiles)
    assert torch.equal(_triton().fused_experts_nvfp4_tiled(x, *spans, weights, ids, tiles, slots), want)
    assert torch.equal(ref.fused_experts_nvfp4_reference(x, *spans, weights, ids, slots),
                       ref.fused_experts_nvfp4_reference(x, *dense, weights, ids))
    assert_close_to_float32(want, ref.fused_experts_nvfp4_reference, x, *dense, weights, ids)


def test_fused_experts_nvfp4_expert_slots_tiles_by_the_layers_experts(rng):
    """Its configurations are those of the slot map's experts (the layer's), not of the cache's
    slots: the contiguous layer's, so the same result."""
    x, spans, slots, dense, weights, ids = _slotted_inputs(rng, 11)
    assert torch.equal(_triton().fused_experts_nvfp4(x, *spans, weights, ids, slots),
                       _triton().fused_experts_nvfp4(x, *dense, weights, ids))
    with pytest.raises(ValueError, match="1-D int32"):
        _triton().fused_experts_nvfp4(x, *spans, weights, ids, slots.long())


def test_expert_major_copies_only_experts_with_strided_rows(rng):
    packed = random_nvfp4(rng, 3, 8, 32)[0]
    assert _triton().expert_major(packed) is packed
    transposed = packed.transpose(1, 2)
    copied = _triton().expert_major(transposed)
    assert copied.is_contiguous() and torch.equal(copied, transposed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_nvfp4_takes_the_dequant_bucket(rng, dtype):
    """Past the table's last W4A16 bucket (96 pairs an expert: 250 tokens of top-3 over 7 experts)
    ``fused_experts_nvfp4`` takes the dequantize path by itself, and stays exact."""
    assert _configs().nvfp4_moe_config("gate_up", torch.bfloat16, 750, 7, 80, 48) is None
    x, w13, w2, weights, ids = _moe_inputs(rng, dtype, 250)
    got = _triton().fused_experts_nvfp4(x, *w13, *w2, weights, ids)
    assert_close_to_float32(got, ref.fused_experts_nvfp4_reference, x, *w13, *w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 33])
def test_nvfp4_linear_dequant_path(rng, dtype, rows, monkeypatch):
    """Past ``LINEAR_DEQUANT_MIN_ROWS`` the dense linear is the reference's own arithmetic
    (dequantize, then a dense GEMM): equal to it in float32, close in bf16."""
    monkeypatch.setattr(_configs(), "LINEAR_DEQUANT_MIN_ROWS", 5)
    w = random_nvfp4(rng, 40, 272)
    x = torch.randn(rows, 272, generator=rng).to(dtype).to(DEVICE)
    got = _triton().nvfp4_linear(x, *w)
    assert_close(got, ref.nvfp4_linear_reference(x, *w), dtype=dtype)


def test_nvfp4_moe_config_buckets_by_pairs_per_expert(monkeypatch):
    """The table is read by mean pairs per expert, a shape's ``TUNED`` entry over ``DEFAULT``."""
    configs = _configs()
    c = _config(32, 128, 64, 4, 8, 4, True)
    monkeypatch.setattr(configs, "TUNED", {("down", 2048, 512, 256): ((20, c), (float("inf"), None))})
    assert configs.nvfp4_moe_config("down", torch.bfloat16, 16 * 256, 256, 2048, 512).block_m == 32
    assert configs.nvfp4_moe_config("down", torch.bfloat16, 64 * 256, 256, 2048, 512) is None
    assert configs.nvfp4_moe_config("gate_up", torch.bfloat16, 8 * 256, 256, 2048, 512) is not None


def test_split_config_needs_two_mma_steps_of_k():
    with pytest.raises(ValueError, match="block_k >= 32"):
        _config(16, 64, 16, 8, 4, 1, True, True, True)


def test_config_needs_four_code_bytes_a_thread():
    """The compiled decode takes a 32-bit word of codes a call: 16 x 32 weights at 4 warps (2 bytes a
    thread) decoded wrong on the H100; 16 x 64 (4 bytes a thread) is the smallest such tile."""
    with pytest.raises(ValueError, match="fewer than 4 a thread"):
        _config(64, 16, 32, 8, 4, 1)
    assert _config(64, 16, 64, 8, 4, 1).block_k == 64


def test_format_buckets_is_python_for_the_table():
    """``format_buckets`` (what the tuner writes into ``TUNED``) evaluates back to the buckets."""
    configs = _configs()
    buckets = ((12.5, _config(16, 64, 128, 8, 4, 3, True)), (float("inf"), None))
    source = configs.format_buckets(buckets, {12.5: "T=528: 100 us"})
    assert "# T=528: 100 us" in source
    assert eval("(" + source + ")", {"C": configs.C, "DEQUANT": configs.DEQUANT}) == buckets


def test_tuner_apply_writes_the_table(tmp_path):
    """``tune_nvfp4_moe.py --apply``: the best configuration of each tuned size goes into its bucket
    (the others keep ``DEFAULT``'s), the module still imports, and the dense threshold becomes the
    smallest tuned row count from which dequantizing won."""
    import importlib.util
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import tune_nvfp4_moe as tuner
    finally:
        sys.path.pop(0)
    best = {"block_m": 32, "block_n": 128, "block_k": 64, "group_m": 4, "num_warps": 8, "num_stages": 4, "swap_ab": True}

    def result(tokens, config):
        gemm = {"results": [{"config": config, "us": 100.0, "gb_s": 4000.0, "current": False}]}
        return {"tokens": tokens, "pairs_per_expert": tokens * 8 / 256, "gate_up": gemm, "down": gemm}

    run = {"device": "test", "date": "today", "hidden": 2048, "inter": 512, "experts_count": 256,
           "experts": [result(528, best), result(8192, "DEQUANT")],
           "dense": {"528": {"qkv": {"w4a16": 1.0, "dequant": 2.0}}, "8192": {"qkv": {"w4a16": 2.0, "dequant": 1.0}}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    target = tmp_path / "nvfp4_configs.py"
    target.write_text(open(os.path.join(root, "kernels", "triton", "nvfp4_configs.py")).read())
    tuner.apply(str(tmp_path / "run.json"), str(target))
    spec = importlib.util.spec_from_file_location("patched_nvfp4_configs", target)
    patched = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = patched  # dataclasses look their module up there
    try:
        spec.loader.exec_module(patched)
    finally:
        del sys.modules[spec.name]
    buckets = patched.TUNED[("down", 2048, 512, 256)]
    assert [b for b, _ in buckets] == [b for b, _ in patched.DEFAULT["down"]]
    assert dict(buckets)[48] == patched.C(**best) and dict(buckets)[float("inf")] is None
    assert dict(buckets)[12] == dict(patched.DEFAULT["down"])[12]
    assert patched.LINEAR_DEQUANT_MIN_ROWS == 8192
