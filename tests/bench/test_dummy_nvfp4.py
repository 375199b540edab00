"""``--load-format dummy`` with an NVFP4 config (``freetoken bench --quantization nvfp4``): the linears
a ModelOpt NVFP4 checkpoint of Qwen3.6 quantizes become random packed weights at unit activation
scale, built without a dense copy, and the HBM floor counts their packed bytes."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.bench.floor import decode_floor, decode_traffic_of, parameter_count
from freetoken.bench.presets import copy_config_dir, preset_config, write_nvfp4_config
from freetoken.cli import main
from freetoken.layers.linear import NVFP4Weight
from freetoken.models.loader import build_model, read_config
from freetoken.models.nvfp4_loading import plan_dummy_nvfp4
from freetoken.models.quantization import QuantizationError, read_quantization

# The demo shape (hidden 64; attention q+gate/k/v 384 x 64, o 64 x 128; 8 experts of gate/up 64 x 64
# and down 64 x 32; shared expert gate/up 96 x 64, down 64 x 48; 3 GDN layers, then attention).
QUANTIZED = {
    **{f"layers.{i}.mlp.{w}": shape for i in range(4)
       for w, shape in (("experts.w13", (8, 64, 64)), ("experts.w2", (8, 64, 32)), ("shared_gate_up", (96, 64)),
                        ("shared_down", (64, 48)))},
    "layers.3.mixer.qkv_proj": (384, 64),
    "layers.3.mixer.o_proj": (64, 128),
}


def nvfp4_bytes(rows: int, cols: int) -> int:
    """Codes (half a byte a weight), e4m3 scales (one byte per 16) and a float32 scale per row."""
    return rows * cols // 2 + rows * cols // 16 + 4 * rows


@pytest.fixture(scope="module")
def nvfp4_dir(demo_checkpoint, tmp_path_factory):
    out = copy_config_dir(demo_checkpoint, tmp_path_factory.mktemp("nvfp4-dummy"))
    write_nvfp4_config(out)
    return out


@pytest.fixture(scope="module")
def nvfp4_llm(nvfp4_dir) -> LLM:
    return LLM(model=str(nvfp4_dir), load_format="dummy", dtype="float32", device="cpu", num_pages=64)


def test_the_released_layout_is_packed_and_the_rest_dense(nvfp4_llm, nvfp4_dir):
    model = nvfp4_llm.runtime.engine.model
    packed = {name: tuple(m.shape) for name, m in model.named_modules() if isinstance(m, NVFP4Weight)}
    assert packed == QUANTIZED
    dense = dict(model.named_parameters())
    for name in ("lm_head", "embed_tokens", "layers.0.mixer.in_proj", "layers.0.mixer.out_proj", "layers.0.mlp.gate_weight"):
        assert dense[name].dtype == torch.float32, name
    assert not any(p.is_meta for p in model.parameters())
    assert not (nvfp4_dir / "model.safetensors").exists()  # no checkpoint was read


def test_packed_weights_are_random_with_unit_activation_scale(nvfp4_llm):
    model = nvfp4_llm.runtime.engine.model
    for name, weight in model.named_modules():
        if not isinstance(weight, NVFP4Weight):
            continue
        dense = weight.dequantize(torch.float32)
        assert torch.isfinite(dense).all(), name
        assert dense.std().item() == pytest.approx(weight.shape[-1] ** -0.5, rel=0.1), name
        assert weight.packed.unique().numel() > 200, f"{name}: codes not random"


def test_logits_are_finite_and_greedy_runs(nvfp4_llm):
    prompt = [5, 17, 230, 3, 99, 41, 8, 300, 12, 7]
    logits = nvfp4_llm.prompt_logits(prompt)
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0  # unit-scale activations through 4 layers, not blown up or collapsed
    out = nvfp4_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_same_seed_same_packed_weights(nvfp4_llm, nvfp4_dir):
    again = LLM(model=str(nvfp4_dir), load_format="dummy", dtype="float32", device="cpu", num_pages=64, seed=0)
    other = LLM(model=str(nvfp4_dir), load_format="dummy", dtype="float32", device="cpu", num_pages=64, seed=1)
    first = nvfp4_llm.runtime.engine.model.layers[0].mlp.w13
    assert torch.equal(first.packed, again.runtime.engine.model.layers[0].mlp.w13.packed)
    assert not torch.equal(first.packed, other.runtime.engine.model.layers[0].mlp.w13.packed)


def test_offloaded_dummy_experts_are_spans_holding_the_resident_values(nvfp4_llm, nvfp4_dir):
    """``moe_offload``: the plan places each layer's packed experts in one span an expert
    (``experts.span``) before they are drawn, and they get the resident model's values."""
    offloaded = LLM(model=str(nvfp4_dir), load_format="dummy", dtype="float32", device="cpu", num_pages=64,
                    moe_offload=True, expert_cache_slots=4)
    resident_layers = nvfp4_llm.runtime.engine.model.layers
    for layer, resident in zip(offloaded.runtime.engine.offload.layers, resident_layers):
        span = layer.host_span()
        assert span is not None and all(p.untyped_storage().data_ptr() == span.untyped_storage().data_ptr()
                                        for p in layer.host_parts())
        want = [t for w in (resident.mlp.w13, resident.mlp.w2) for t in (w.packed, w.scales, w.row_scales)]
        assert all(torch.equal(got.view(torch.uint8), w.view(torch.uint8)) for got, w in zip(layer.host_parts(), want))


def test_an_nvfp4_build_keeps_parameters_off_the_device_until_planned(nvfp4_dir):
    config = read_config(str(nvfp4_dir))
    model = build_model(config, torch.float32, torch.device("cpu"), meta_parameters=True)
    assert all(p.is_meta for p in model.parameters())
    assert model.rotary_cache.device.type == "cpu"  # buffers computed at build time are real
    plan = plan_dummy_nvfp4(model, model.weight_targets(), read_quantization(str(nvfp4_dir), config), torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
    params = {id(p) for p in model.parameters()}
    assert all(id(t.param) in params for t in plan.targets.values())  # targets point at the allocated parameters


def test_a_selected_linear_with_an_odd_input_dim_is_an_error(demo_checkpoint, tmp_path):
    out = copy_config_dir(demo_checkpoint, tmp_path / "odd")
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["shared_expert_intermediate_size"] = 40
    (out / "config.json").write_text(json.dumps(config))
    write_nvfp4_config(out)
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.mlp\.shared_expert\.down_proj has 40 input columns"):
        LLM(model=str(out), load_format="dummy", dtype="float32", device="cpu", num_pages=16)


def _bench(argv: list[str], out) -> dict:
    common = ["--batch-sizes", "3", "--input-len", "4", "--output-len", "3", "--dtype", "bfloat16", "--device", "cpu"]
    assert main(["bench", *argv, *common, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_nvfp4_counts_packed_bytes_in_the_floor(demo_checkpoint, tmp_path, capsys):
    model = ["--model", str(demo_checkpoint), "--load-format", "dummy"]
    dense = _bench(model, tmp_path / "bf16.json")
    nvfp4 = _bench([*model, "--quantization", "nvfp4"], tmp_path / "nvfp4.json")
    assert "(nvfp4 linears)" in capsys.readouterr().out
    assert nvfp4["quantization"] == "nvfp4" and nvfp4["num_parameters"] == dense["num_parameters"]
    # Per layer, dense linears that became packed: the shared expert, and attention in layer 3.
    shared = [(96, 64), (64, 48)]
    attention = [(384, 64), (64, 128)]
    saved = sum(2 * r * c - nvfp4_bytes(r, c) for r, c in 4 * shared + attention)
    expert = nvfp4_bytes(64, 64) + nvfp4_bytes(64, 32)
    assert expert / (2 * 3 * 64 * 32) == pytest.approx(0.3229, abs=1e-4)  # 4.5 bits a weight + row scales
    assert dense["weight_bytes"] - nvfp4["weight_bytes"] == saved + 4 * 8 * (2 * 3 * 64 * 32 - expert)
    for q, d in zip(nvfp4["results"], dense["results"]):
        qf, df = q["floor"], d["floor"]
        assert torch.isfinite(torch.tensor([q["decode_ms_per_step"], qf["ms"]])).all()
        assert qf["experts_per_layer"] == df["experts_per_layer"]
        assert qf["expert_weight_bytes"] == pytest.approx(df["expert_weight_bytes"] * expert / (2 * 3 * 64 * 32))
        assert df["non_expert_weight_bytes"] - qf["non_expert_weight_bytes"] == saved
        assert (qf["kv_bytes"], qf["state_bytes"]) == (df["kv_bytes"], df["state_bytes"])
        assert qf["ms"] < df["ms"]


def test_bench_quantization_needs_random_weights(demo_checkpoint):
    with pytest.raises(SystemExit, match="--quantization makes random quantized weights"):
        main(["bench", "--model", str(demo_checkpoint), "--quantization", "nvfp4"])
    with pytest.raises(SystemExit, match="not with --quantization"):
        main(["bench", "--preset", "qwen3.6-35b-a3b", "--quantization", "nvfp4", "--compare-transformers"])


@pytest.fixture(scope="module")
def qwen3_6_traffic(tmp_path_factory):
    """The floor's inputs of the Qwen3.6-35B-A3B shape in bf16 and with its NVFP4 layout, on ``meta``."""
    config = preset_config("qwen3.6-35b-a3b")
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    dense = decode_traffic_of(model)
    quantization = read_quantization(write_nvfp4_config(tmp_path_factory.mktemp("q")).parent, config)
    plan_dummy_nvfp4(model, model.weight_targets(), quantization, torch.device("meta"))
    assert parameter_count(model) == pytest.approx(34.66e9, rel=1e-3)
    return dense, decode_traffic_of(model)


@pytest.mark.parametrize("batch_size, bf16_ms, nvfp4_ms", [(1, 1.41, 0.94), (64, 16.2, 6.70), (128, 20.1, 9.44)])
def test_qwen3_6_nvfp4_floor(qwen3_6_traffic, batch_size, bf16_ms, nvfp4_ms):
    """Experts at 0.283x their bf16 bytes: the floors docs/benchmarks.md compares the H200 runs with."""
    dense, nvfp4 = qwen3_6_traffic
    assert nvfp4.expert_bytes / dense.expert_bytes == pytest.approx(0.2832, abs=1e-4)
    assert decode_floor(dense, batch_size, 1024 + 64).seconds * 1e3 == pytest.approx(bf16_ms, abs=0.06)
    assert decode_floor(nvfp4, batch_size, 1024 + 64).seconds * 1e3 == pytest.approx(nvfp4_ms, abs=0.01)
