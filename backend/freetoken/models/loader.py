"""Hugging Face model directory -> a FreeToken model with its weights on the target device."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from freetoken.experts.offload import ExpertOffload, building
from freetoken.layers.weights import parameters_on
from freetoken.models.base import CausalLM
from freetoken.models.checkpoint import CheckpointError, canonical_name, count_tensors, iterate_tensors, shard_files
from freetoken.models.nvfp4_loading import plan_dummy_nvfp4, plan_nvfp4
from freetoken.models.quantization import NVFP4Config, read_quantization
from freetoken.models.registry import family_of, text_config_of

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: CausalLM
    config: PretrainedConfig
    generation_config: GenerationConfig | None
    dtype: torch.dtype
    eos_token_ids: set[int] = field(default_factory=set)


def read_config(model_dir: str) -> PretrainedConfig:
    if not (Path(model_dir) / "config.json").exists():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"cannot read the model config in {model_dir}: {exc}") from exc


def resolve_dtype(name: str, config: PretrainedConfig) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    stored = getattr(text_config_of(config), "dtype", None) or getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored)
    return stored if isinstance(stored, torch.dtype) else torch.bfloat16


def _eos_ids(*values) -> set[int]:
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def build_model(
    config: PretrainedConfig,
    torch_dtype: torch.dtype,
    device: torch.device,
    meta_parameters: bool = False,
    offload: ExpertOffload | None = None,
) -> CausalLM:
    """The model of ``config``'s architecture with uninitialised weights on ``device``; with
    ``meta_parameters``, its parameters on ``meta`` (buffers on ``device``), for an NVFP4 plan to
    replace and allocate (``plan_nvfp4``); with ``offload``, the routed experts' weights are made in
    host memory instead (never on the device)."""
    family = family_of(getattr(config, "architectures", None))
    text_config = text_config_of(config)
    tie = bool(getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False))
    previous_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch_dtype)
        with torch.device(device), parameters_on(torch.device("meta") if meta_parameters else None), building(offload):
            model = family.build(text_config, tie)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model.eval()


def load_model(model_dir: str, dtype: str, device: torch.device, offload: ExpertOffload | None = None) -> LoadedModel:
    config = read_config(model_dir)
    text_config = text_config_of(config)
    torch_dtype = resolve_dtype(dtype, config)
    quantization = read_quantization(model_dir, config)
    model = build_model(config, torch_dtype, device, meta_parameters=quantization is not None, offload=offload)
    load_weights(model, model_dir, quantization, device)
    generation_config = None
    if (Path(model_dir) / "generation_config.json").exists():
        generation_config = GenerationConfig.from_pretrained(model_dir)
    eos = _eos_ids(
        getattr(text_config, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None) if generation_config else None,
    )
    return LoadedModel(model, config, generation_config, torch_dtype, eos)


def load_random_model(
    model_dir: str, dtype: str, device: torch.device, seed: int, offload: ExpertOffload | None = None
) -> LoadedModel:
    """The model of ``model_dir``'s config with random weights made where they live
    (``load_format="dummy"``): for benchmarks of real shapes without a checkpoint. With an NVFP4
    quantization config, the linears it selects are random packed weights (``plan_dummy_nvfp4``);
    with ``offload``, the routed experts live in host memory and are drawn on ``device``. See
    ``models.random_weights``."""
    from freetoken.models.random_weights import randomize_weights

    config = read_config(model_dir)
    quantization = read_quantization(model_dir, config)
    torch_dtype = resolve_dtype(dtype, config)
    model = build_model(config, torch_dtype, device, meta_parameters=quantization is not None, offload=offload)
    targets = model.weight_targets()
    if quantization is not None:
        targets = plan_dummy_nvfp4(model, targets, quantization, device).targets
    randomize_weights(model, seed, targets, device)
    eos = _eos_ids(getattr(text_config_of(config), "eos_token_id", None))
    return LoadedModel(model, config, None, torch_dtype, eos)


@torch.no_grad()
def load_weights(
    model: CausalLM, model_dir: str, quantization: NVFP4Config | None = None, device: torch.device | None = None
) -> None:
    """Copy every checkpoint tensor into its target; error on wrong shapes and on parameters left unfilled.

    With an NVFP4 ``quantization``, the linears the checkpoint quantized are replaced by packed
    weights first (``plan_nvfp4``; on ``device``, which also receives the parameters a
    ``meta_parameters`` build left on ``meta``) and filled from their packed tensors.
    """
    targets = model.weight_targets()
    files = shard_files(model_dir)
    plan = plan_nvfp4(model, targets, files, quantization, device) if quantization else None
    if plan:
        targets = plan.targets
    total = sum(count_tensors(f) for f in files)
    filled: dict[int, int] = {}
    unexpected: list[str] = []
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None) as progress:
        for path in files:
            for name, tensor in iterate_tensors(path):
                progress.update(1)
                canonical = canonical_name(name)
                if canonical is None:
                    continue
                target = targets.get(canonical)
                if target is None:
                    if not (plan and canonical in plan.unused):
                        unexpected.append(name)
                    continue
                destination = target.destination()
                tensor = target.convert(tensor) if target.convert else tensor
                destination.copy_(_fit(tensor, destination, name, path))
                filled[id(target.param)] = filled.get(id(target.param), 0) + destination.numel()
    if unexpected:
        logger.warning("ignored %d checkpoint tensors FreeToken does not use, e.g. %s", len(unexpected), unexpected[:5])
    params = {name: p for name, p in model.named_parameters()}
    tied = model.tied_weights()
    for target in targets.values():
        if target.zero:
            target.destination().zero_()
            filled[id(target.param)] = filled.get(id(target.param), 0) + target.destination().numel()
    missing = []
    for canonical, target in targets.items():
        if filled.get(id(target.param), 0) >= target.param.numel():
            continue
        if canonical in tied:
            target.destination().copy_(targets[tied[canonical]].destination())
            filled[id(target.param)] = target.param.numel()
            continue
        missing.append(canonical)
    unfilled = [n for n, p in params.items() if filled.get(id(p), 0) < p.numel()]
    if unfilled:
        examples = [m for m in missing if ".experts." not in m][:5] or missing[:5]
        raise CheckpointError(
            f"checkpoint {model_dir} lacks weights for {len(unfilled)} parameters "
            f"(e.g. {', '.join(examples or unfilled[:5])})"
        )


def _fit(tensor: torch.Tensor, destination: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    """The checkpoint tensor in the destination's shape, or a ``CheckpointError`` naming both shapes.

    Tolerated: extra singleton dims (``conv1d.weight [C, 1, K]``) and fused expert tensors stored
    transposed (``[E, H, 2I]`` for ``[E, 2I, H]``).
    """
    if tensor.shape == destination.shape:
        return tensor
    if tensor.numel() == destination.numel():
        if [d for d in tensor.shape if d != 1] == [d for d in destination.shape if d != 1]:
            return tensor.reshape(destination.shape)
        if tensor.dim() == 3 and tensor.transpose(1, 2).shape == destination.shape:
            return tensor.transpose(1, 2)
    hint = " (packed 4-bit? the checkpoint has no NVFP4 quantization config)" if tensor.dtype == torch.uint8 else ""
    raise CheckpointError(
        f"tensor {name} in {path} has shape {tuple(tensor.shape)}, but the model config needs {tuple(destination.shape)}{hint}"
    )
