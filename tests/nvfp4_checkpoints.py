"""NVFP4 checkpoints made by the real producers from the tiny random test checkpoints, and their
dequantized twins, which transformers runs as the oracle.

- ModelOpt: ``mtq.quantize`` (NVFP4_DEFAULT_CFG, a short calibration) + ``export_hf_checkpoint``,
  exactly what NVIDIA runs for its published checkpoints.
- compressed-tensors: the library's own NVFP4 scale generation (``generate_gparam``,
  ``calculate_qparams``), its ``NVFP4PackedCompressor`` and its ``QuantizationConfig``: what
  llm-compressor writes, without llm-compressor's calibration machinery (weight-only needs none).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken.demo import build_checkpoint
from freetoken.kernels.nvfp4 import GROUP_SIZE, dequantize_nvfp4
from freetoken.models.quantization import read_quantization

_KEEP = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json")


def _hf_model(src: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(src)
    return getattr(transformers, config.architectures[0]).from_pretrained(src, dtype=torch.float32).eval()


def _copy_tokenizer(src: Path, out: Path) -> None:
    for name in _KEEP:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as shard:
            tensors.update({name: shard.get_tensor(name) for name in shard.keys()})
    return tensors


def modelopt_checkpoint(src: Path, out: Path) -> Path:
    """``src`` quantized by ModelOpt (NVFP4, its default exclusions) and exported as a HF checkpoint."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = _hf_model(src)
    ids = torch.randint(0, model.config.get_text_config().vocab_size - 4, (1, 8), generator=torch.Generator().manual_seed(0))
    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(out))
    _copy_tokenizer(src, out)
    return out


def linear_modules(model: torch.nn.Module) -> dict[str, int]:
    """``{checkpoint module name: input dim}`` of every linear, fused experts as the per-expert
    ``experts.N.{gate,up,down}_proj`` linears the checkpoints store."""
    linears = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            linears[name] = module.in_features
        elif type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            hidden, inter = module.gate_up_proj.shape[-1], module.down_proj.shape[-1]
            for e in range(module.gate_up_proj.shape[0]):
                linears.update({f"{name}.{e}.gate_proj": hidden, f"{name}.{e}.up_proj": hidden, f"{name}.{e}.down_proj": inter})
    return linears


def compressed_tensors_checkpoint(src: Path, out: Path, ignore: list[str]) -> Path:
    """``src`` with every ``Linear`` not matched by ``ignore`` in compressed-tensors NVFP4 (W4A16);
    linears whose input dim is not a multiple of 16 are ignored by exact name, as a recipe must."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from compressed_tensors.utils.match import match_name

    linears = linear_modules(_hf_model(src))
    ignore = ignore + sorted(n for n, cols in linears.items() if cols % GROUP_SIZE)
    scheme = QuantizationScheme(targets=["Linear"], format="nvfp4-pack-quantized", **NVFP4A16)
    tensors = _tensors(src)
    for module in linears:
        if any(match_name(module, pattern) for pattern in ignore):
            continue
        weight = tensors.pop(f"{module}.weight").float()
        global_scale = generate_gparam(weight.min(), weight.max())
        groups = weight.unflatten(-1, (-1, GROUP_SIZE))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
        state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
        compressed = NVFP4PackedCompressor.compress(state, scheme)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in compressed.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=ignore, format="nvfp4-pack-quantized", quantization_status="compressed"
    )
    config["quantization_config"] = {"quant_method": "compressed-tensors", **qconfig.model_dump(mode="json")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(src, out)
    return out


def dequantized_checkpoint(quantized: Path, out: Path) -> Path:
    """The NVFP4 checkpoint with every packed linear dequantized to float32 (``e2m1 · e4m3 ·
    scale_2``, ``/ global_scale`` for compressed-tensors) and no quantization config."""
    config = json.loads((quantized / "config.json").read_text())
    names = read_quantization(quantized, transformers.AutoConfig.from_pretrained(quantized)).names
    tensors = _tensors(quantized)
    modules = [n.removesuffix(f".{names.packed}") for n, t in tensors.items() if n.endswith(f".{names.packed}") and t.dtype == torch.uint8]
    for module in modules:
        packed = tensors.pop(f"{module}.{names.packed}")
        scales = tensors.pop(f"{module}.{names.block_scale}")
        global_scale = tensors.pop(f"{module}.{names.global_scale}").float().reshape(1)
        row_scale = (1.0 / global_scale if names.global_divides else global_scale).expand(packed.shape[0])
        for unused in names.unused:
            tensors.pop(f"{module}.{unused}", None)
        tensors[f"{module}.weight"] = dequantize_nvfp4(packed, scales, row_scale, torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(quantized, out)
    return out


# Exclusions as the published recipes write them: the routers and the vision tower stay dense.
CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*visual.*"]
# ModelOpt's export needs every quantized linear's input dim divisible by 16: Qwen4-Exp's demo
# shared expert (24) and hyper-connection rank (8) are widened.
FAMILIES: dict[str, dict] = {"qwen3_5_moe": {}, "qwen4_exp": dict(shared_expert_intermediate_size=32, hc_lowrank=16)}
FORMATS = ("modelopt", "compressed-tensors")


@functools.cache
def case(family: str, producer: str) -> tuple[Path, Path]:
    """``(NVFP4 checkpoint, its dequantized twin)`` of the family's tiny random checkpoint, built once a process."""
    root = Path(tempfile.mkdtemp(prefix=f"nvfp4-{family}-{producer}-"))
    atexit.register(shutil.rmtree, root, True)
    src = build_checkpoint(root / "src", FAMILIES[family], family=family, seed=5)
    if producer == "modelopt":
        quantized = modelopt_checkpoint(src, root / "nvfp4")
    else:
        quantized = compressed_tensors_checkpoint(src, root / "nvfp4", CT_IGNORE)
    return quantized, dequantized_checkpoint(quantized, root / "dequantized")
