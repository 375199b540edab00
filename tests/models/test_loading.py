"""Loading checkpoints: layouts that must work and failures that must be clear."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle import DEMO, PROMPTS, Case, checkpoint
from freetoken import LLM, SamplingParams
from freetoken.models.checkpoint import CheckpointError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _greedy(path: Path) -> list[int]:
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    return llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids


def test_fused_expert_tensors_load_like_per_expert_ones(demo_checkpoint, tmp_path):
    fused = _copy(demo_checkpoint, tmp_path / "fused")
    tensors = load_file(fused / "model.safetensors")
    prefix = "model.language_model.layers"
    for layer in range(4):
        experts = f"{prefix}.{layer}.mlp.experts"
        count = len({k.split(".")[6] for k in tensors if k.startswith(experts + ".")})
        gate_up = [torch.cat([tensors.pop(f"{experts}.{e}.gate_proj.weight"),
                              tensors.pop(f"{experts}.{e}.up_proj.weight")]) for e in range(count)]
        down = [tensors.pop(f"{experts}.{e}.down_proj.weight") for e in range(count)]
        tensors[f"{experts}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{experts}.down_proj"] = torch.stack(down)
    save_file(tensors, fused / "model.safetensors")
    assert _greedy(fused) == _greedy(demo_checkpoint)


def test_router_rows_load_and_the_alignment_rows_are_zero(demo_checkpoint):
    """The router + shared-gate weight is padded to a multiple of 8 rows: the checkpoint fills the
    real rows, the rest are zero."""
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")
    tensors = load_file(demo_checkpoint / "model.safetensors")
    mlp = llm.runtime.engine.model.layers[0].mlp
    e = mlp.num_experts
    prefix = "model.language_model.layers.0.mlp"
    assert mlp.gate_weight.shape[0] % 8 == 0 and mlp.gate_weight.shape[0] > e + 1
    assert torch.equal(mlp.gate_weight[:e], tensors[f"{prefix}.gate.weight"])
    assert torch.equal(mlp.gate_weight[e : e + 1], tensors[f"{prefix}.shared_expert_gate.weight"])
    assert not mlp.gate_weight[e + 1 :].any()


def test_unknown_architecture_is_named(demo_checkpoint, tmp_path):
    path = _copy(demo_checkpoint, tmp_path / "arch")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        LLM(model=str(path), device="cpu")


def test_missing_directory_or_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(model=str(tmp_path), device="cpu")


def test_missing_shard_is_named(tmp_path):
    path = _copy(checkpoint(Case("qwen3_5_moe", "text_only_tied_sharded")), tmp_path / "sharded")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"missing: .*{shards[-1].name}"):
        LLM(model=str(path), device="cpu")


def test_corrupt_shard_is_named(demo_checkpoint, tmp_path):
    path = _copy(demo_checkpoint, tmp_path / "corrupt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(model=str(path), device="cpu")


def test_shape_that_does_not_match_the_config(demo_checkpoint, tmp_path):
    path = _copy(demo_checkpoint, tmp_path / "shape")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"experts\.\d+\..*shape \(\d+, \d+\).*needs \(\d+, \d+\)"):
        LLM(model=str(path), device="cpu")


def test_missing_tensor_is_named(demo_checkpoint, tmp_path):
    path = _copy(demo_checkpoint, tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.language_model.layers.3.self_attn.o_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.3\.self_attn\.o_proj\.weight"):
        LLM(model=str(path), device="cpu")


def test_generation_config_defaults_apply(demo_checkpoint, tmp_path):
    path = _copy(demo_checkpoint, tmp_path / "genconfig")
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.95, top_k=20)
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), device="cpu")
    resolved = llm.runtime.make_request("g", "hi", SamplingParams()).sampling
    assert (resolved.temperature, resolved.top_p, resolved.top_k) == (0.6, 0.95, 20)
    explicit = llm.runtime.make_request("h", "hi", SamplingParams(temperature=0.0)).sampling
    assert explicit.temperature == 0.0


def test_page_size_and_compress_ratio_must_divide_one_another():
    with pytest.raises(ValueError, match=r"page_size \(6\) and indexer_compress_ratio \(4\)"):
        LLM(model=str(checkpoint(DEMO["qwen4_exp"])), dtype="float32", device="cpu", page_size=6)
