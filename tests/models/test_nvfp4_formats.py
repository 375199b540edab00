"""NVFP4 formats: config parsing into per-module decisions, errors naming the field, and FreeToken's
dequantization checked against the producers' own (ModelOpt's NVFP4QTensor, compressed-tensors'
unpacker, dequantizer and ModelOpt converter)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from freetoken.kernels.nvfp4 import dequantize_nvfp4, unpack_e2m1
from freetoken.models.nvfp4_loading import quantized_modules
from freetoken.models.quantization import COMPRESSED_TENSORS, MODELOPT, QuantizationError, read_quantization
from nvfp4_checkpoints import case


def _modelopt_dir(tmp_path, **quantization):
    section = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*mlp.gate", "*linear_attn*"]}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {**section, **quantization}}))
    return tmp_path


def _ct_config(**weights) -> SimpleNamespace:
    group = {
        "targets": ["Linear"],
        "format": "nvfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True, **weights},
    }
    return SimpleNamespace(
        quantization_config={
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*mlp\\.gate$", "model.layers.1.self_attn.o_proj"],
        }
    )


def test_modelopt_exclusions_are_exact_names_and_fnmatch_patterns(tmp_path):
    config = read_quantization(_modelopt_dir(tmp_path), SimpleNamespace())
    assert config.names is MODELOPT
    assert config.quantizes("model.layers.0.self_attn.q_proj")
    assert config.quantizes("model.layers.0.mlp.experts.3.gate_proj")
    assert config.quantizes("model.layers.0.mlp.shared_expert.gate_proj")
    assert not config.quantizes("model.layers.0.mlp.gate")
    assert not config.quantizes("model.layers.0.linear_attn.in_proj_qkv")
    assert not config.quantizes("lm_head")


def test_modelopt_config_json_form(tmp_path):
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    config = read_quantization(tmp_path, SimpleNamespace(quantization_config=qc))
    assert config.names is MODELOPT and not config.quantizes("lm_head") and config.quantizes("model.layers.0.mlp.gate")


def test_compressed_tensors_targets_minus_ignore(tmp_path):
    config = read_quantization(tmp_path, _ct_config())
    assert config.names is COMPRESSED_TENSORS and config.names.global_divides
    assert config.quantizes("model.layers.0.mlp.shared_expert_gate")
    assert not config.quantizes("model.layers.0.mlp.gate")
    assert not config.quantizes("model.layers.1.self_attn.o_proj")
    assert config.quantizes("model.layers.2.self_attn.o_proj")


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(quant_algo="FP8"), "quantization.quant_algo"),
        (dict(group_size=32), "quantization.group_size"),
    ],
)
def test_modelopt_config_errors_name_the_field(tmp_path, change, field):
    with pytest.raises(QuantizationError, match=field):
        read_quantization(_modelopt_dir(tmp_path, **change), SimpleNamespace())


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(group_size=32), "config_groups.group_0.weights.group_size"),
        (dict(num_bits=8), "config_groups.group_0.weights.num_bits"),
        (dict(type="int"), "config_groups.group_0.weights.type"),
    ],
)
def test_compressed_tensors_config_errors_name_the_field(tmp_path, change, field):
    with pytest.raises(QuantizationError, match=field):
        read_quantization(tmp_path, _ct_config(**change))


def test_other_quantization_methods_are_refused_by_name(tmp_path):
    with pytest.raises(QuantizationError, match="quant_method is 'gptq'"):
        read_quantization(tmp_path, SimpleNamespace(quantization_config={"quant_method": "gptq"}))
    assert read_quantization(tmp_path, SimpleNamespace()) is None


def _headers(**changes):
    module = "model.layers.0.self_attn.o_proj"
    tensors = {"weight": ("U8", [8, 16]), "weight_scale": ("F8_E4M3", [8, 2]), "weight_scale_2": ("F32", []), **changes}
    return {module: {k: v for k, v in tensors.items() if v is not None}}


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(weight_scale_2=None), "o_proj.weight_scale_2 is missing"),
        (dict(weight_scale=None), "o_proj.weight_scale is missing"),
        (dict(weight=("U8", [8, 12]), weight_scale=("F8_E4M3", [8, 2])), "24 input columns, not a multiple of the group size 16"),
        (dict(weight_scale=("F8_E4M3", [8, 4])), "weight_scale has shape"),
    ],
)
def test_checkpoint_errors_name_the_tensor(tmp_path, changes, message):
    config = read_quantization(_modelopt_dir(tmp_path), SimpleNamespace())
    with pytest.raises(QuantizationError, match=message):
        quantized_modules(_headers(**changes), config)


def test_a_packed_module_the_config_excludes_is_an_error(tmp_path):
    config = read_quantization(_modelopt_dir(tmp_path, exclude_modules=["*o_proj"]), SimpleNamespace())
    with pytest.raises(QuantizationError, match="exclude_modules excludes it"):
        quantized_modules(_headers(), config)


def test_e2m1_codes_match_compressed_tensors_unpacker():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    theirs = unpack_fp4_from_uint8(every_byte, 16, 32, dtype=torch.float32)
    assert torch.equal(unpack_e2m1(every_byte), theirs)


def _module_tensors(model_dir, suffix: str, count: int = 6) -> dict[str, dict[str, torch.Tensor]]:
    """A few quantized modules' tensors (attention, GDN, routed and shared experts)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as shard:
        names = sorted(n for n in shard.keys() if n.endswith(f".{suffix}") and shard.get_slice(n).get_dtype() == "U8")
        for name in names[:: max(1, len(names) // count)]:
            module = name.removesuffix(f".{suffix}")
            out[module] = {k.rpartition(".")[2]: shard.get_tensor(k) for k in shard.keys() if k.rpartition(".")[0] == module}
    return out


def _args():
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return NVFP4A16["weights"]


def test_dequantization_matches_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    quantized, _ = case("qwen3_5_moe", "compressed-tensors")
    modules = _module_tensors(quantized, "weight_packed")
    assert len(modules) >= 4
    for module, t in modules.items():
        rows, half = t["weight_packed"].shape
        codes = unpack_fp4_from_uint8(t["weight_packed"], rows, 2 * half, dtype=torch.float32)
        theirs = dequantize(codes, t["weight_scale"].float(), args=_args(), global_scale=t["weight_global_scale"], dtype=torch.float32)
        ours = dequantize_nvfp4(t["weight_packed"], t["weight_scale"], (1 / t["weight_global_scale"]).expand(rows), torch.float32)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0, msg=module)


def test_modelopt_dequantization_matches_modelopt_and_compressed_tensors_converter():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    quantized, _ = case("qwen3_5_moe", "modelopt")
    modules = _module_tensors(quantized, "weight")
    assert len(modules) >= 4
    for module, t in modules.items():
        rows, half = t["weight"].shape
        ours = dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(1).expand(rows), torch.float32)
        qtensor = NVFP4QTensor(torch.Size([rows, 2 * half]), torch.float32, t["weight"])
        modelopt = qtensor.dequantize(
            dtype=torch.float32, scale=t["weight_scale"], double_scale=t["weight_scale_2"], block_sizes={-1: 16}
        )
        torch.testing.assert_close(ours, modelopt, rtol=1e-6, atol=0, msg=module)
        converted = ModelOptNvfp4Converter(targets=["re:.*"]).process({f"{module}.{k}": v for k, v in t.items()})
        codes = unpack_fp4_from_uint8(converted[f"{module}.weight_packed"], rows, 2 * half, dtype=torch.float32)
        ct = dequantize(
            codes, converted[f"{module}.weight_scale"].float(), args=_args(),
            global_scale=converted[f"{module}.weight_global_scale"], dtype=torch.float32,
        )
        torch.testing.assert_close(ours, ct, rtol=1e-6, atol=0, msg=module)
