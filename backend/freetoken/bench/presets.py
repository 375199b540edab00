"""Real architectures to benchmark without their checkpoints: a ``config.json`` (and the demo's
small tokenizer, since prompts are token ids) written to a directory; the engine makes random
weights for it on the device (``load_format="dummy"``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# Qwen3.6-35B-A3B's text model, as published for Qwen3.5/3.6-35B-A3B (architecture Qwen3_5Moe):
# transformers' Qwen3_5MoeTextConfig defaults plus the released rope and context fields.
QWEN3_6_35B_A3B: dict[str, Any] = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    full_attention_interval=4,  # 3 Gated DeltaNet layers, then 1 full attention layer
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    tie_word_embeddings=False,
    eos_token_id=248044,
    dtype="bfloat16",
)

# Qwen4-Exp: transformers' Qwen4ExpTextConfig defaults (40 layers, hidden 2048, 512 experts top-10,
# 4 hyper-connection streams of rank 320) with Qwen3.6's attention, rope and context. No released
# config fixes the QSA indexer and PLE fields; these are plausible values. The PLE n-gram table is
# shrunk from ~41B rows x dims (ngram_vocab_size_base 20M, ~82 GiB of host memory) to ~0.5B: a step
# reads the same number of rows (tokens x 16 heads), so only the table's footprint differs.
QWEN4_EXP: dict[str, Any] = dict(
    QWEN3_6_35B_A3B,
    num_experts=512,
    num_experts_per_tok=10,
    norm_topk_prob=True,
    hc_count=4,
    hc_lowrank=320,
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    ple_layer_ids=[1],
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=262144,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=1,
)

# What NVIDIA's ModelOpt NVFP4 checkpoint of Qwen3.6-35B-A3B leaves dense (``exclude_modules`` of its
# hf_quant_config.json): the Gated DeltaNet layers, the router and shared-expert gate, lm_head, and
# the vision tower and MTP head (not part of the text model). Quantized: the routed and shared
# experts and the full-attention projections. The same exclusions serve the Qwen4-Exp preset.
NVFP4_EXCLUDE_MODULES = ["lm_head", "*linear_attn*", "*mlp.gate", "*mlp.shared_expert_gate", "*visual*", "*mtp*"]

# name -> (transformers text config class, architecture, fields)
PRESETS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3.6-35b-a3b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN3_6_35B_A3B),
    "qwen4-exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", QWEN4_EXP),
}


def preset_config(name: str, num_layers: int | None = None):
    """The transformers text config of preset ``name``, with its first ``num_layers`` layers."""
    import transformers

    if name not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {name!r}")
    class_name, architecture, fields = PRESETS[name]
    fields = dict(fields)
    if num_layers is not None:
        if not 1 <= num_layers <= fields["num_hidden_layers"]:
            raise ValueError(f"num_layers must be in [1, {fields['num_hidden_layers']}], got {num_layers}")
        fields["num_hidden_layers"] = num_layers
        if "ple_layer_ids" in fields:
            fields["ple_layer_ids"] = [i for i in fields["ple_layer_ids"] if i <= num_layers]
    config = getattr(transformers, class_name)(**fields)
    config.architectures = [architecture]
    return config


def write_preset_dir(name: str, out_dir: str | Path, num_layers: int | None = None) -> Path:
    """``out_dir`` with the preset's ``config.json`` and a small tokenizer; no weights."""
    from freetoken.demo import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    preset_config(name, num_layers).save_pretrained(str(out))
    build_tokenizer(out)
    return out


def write_nvfp4_config(model_dir: str | Path, exclude_modules: list[str] | None = None) -> Path:
    """A ModelOpt ``hf_quant_config.json`` (NVFP4, groups of 16) in ``model_dir``: a dummy load of
    that directory makes the linears it selects random packed weights."""
    path = Path(model_dir) / "hf_quant_config.json"
    quantization = {
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": list(NVFP4_EXCLUDE_MODULES if exclude_modules is None else exclude_modules),
    }
    path.write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization}, indent=2) + "\n")
    return path


def copy_config_dir(model_dir: str | Path, out_dir: str | Path) -> Path:
    """``model_dir`` without its weights (config, tokenizer, ...) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".pt")):
            shutil.copy(path, out / path.name)
    return out
