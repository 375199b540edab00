"""Loading an NVFP4 checkpoint: which model parameters stay packed, and where each packed tensor goes.

The safetensors headers (names, dtypes, shapes; no data) say which linears are stored quantized;
the config must agree. A model parameter whose checkpoint parts are all quantized (a fused q/k/v,
the gate/up rows of every expert) becomes an :class:`NVFP4Weight`; a fused 2-D one that mixes
quantized and dense parts (ModelOpt leaves the GDN ``in_proj_a/b`` dense beside a quantized
``in_proj_qkv/z``) becomes a :class:`SplitWeight` of packed and dense row runs.

Offloaded NVFP4 experts (``moe_offload``) are placed in one byte span an expert in host memory
(``OffloadedExperts.place_span``, layer by layer) before any is filled, so the checkpoint's tensors
go straight into it.

A model built with its parameters on ``meta`` (``layers.weights.parameters_on``) never holds the
quantized linears in the activation dtype: the plan creates the packed weights on the device and
then allocates the dense parameters left (``device`` given). Without a checkpoint
(``load_format="dummy"``), ``plan_dummy_nvfp4`` quantizes the linears the config selects, as a
checkpoint of that config would store them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from freetoken.experts.store import OffloadedExperts
from freetoken.layers.linear import NVFP4Weight, SplitWeight
from freetoken.layers.weights import WeightTarget
from freetoken.models.checkpoint import CheckpointError, canonical_name
from freetoken.models.quantization import GROUP_SIZE, NVFP4Config, QuantizationError


@dataclass
class NVFP4Load:
    targets: dict[str, WeightTarget]
    unused: set[str] = field(default_factory=set)  # canonical names W4A16 does not read (input scales)


def _headers(files: list[Path]) -> dict[str, dict[str, tuple[str, list[int]]]]:
    """``{checkpoint module: {tensor suffix: (dtype, shape)}}`` from the shards' headers."""
    modules: dict[str, dict[str, tuple[str, list[int]]]] = defaultdict(dict)
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    piece = shard.get_slice(name)
                    module, _, suffix = name.rpartition(".")
                    modules[module][suffix] = (piece.get_dtype(), piece.get_shape())
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read checkpoint shard {path}: {exc}") from exc
    return modules


def quantized_modules(headers: dict[str, dict[str, tuple[str, list[int]]]], config: NVFP4Config) -> set[str]:
    """The canonical names of the linears the checkpoint stores as NVFP4, checked against the
    config and for complete, consistent tensors."""
    names = config.names
    found: set[str] = set()
    for module, tensors in headers.items():
        packed = tensors.get(names.packed)
        if packed is None or packed[0] != "U8":
            continue
        canonical = canonical_name(module)
        if canonical is None:
            continue
        if not config.quantizes(module):
            raise QuantizationError(f"{module} is stored as NVFP4 ({names.packed} uint8), but {config.exclusion_field} excludes it")
        for scale in (names.block_scale, names.global_scale):
            if scale not in tensors:
                raise QuantizationError(
                    f"{module}.{scale} is missing: an NVFP4 linear needs {names.packed}, {names.block_scale} and {names.global_scale}"
                )
        rows, half = packed[1]
        cols = 2 * half
        if cols % GROUP_SIZE:
            raise QuantizationError(
                f"{module}.{names.packed} [{rows}, {half}] holds {cols} input columns, not a multiple of the group size {GROUP_SIZE}"
            )
        if tensors[names.block_scale][1] != [rows, cols // GROUP_SIZE]:
            raise QuantizationError(
                f"{module}.{names.block_scale} has shape {tensors[names.block_scale][1]}, "
                f"but {names.packed} [{rows}, {half}] needs [{rows}, {cols // GROUP_SIZE}]"
            )
        if tensors[names.block_scale][0] != "F8_E4M3":
            raise QuantizationError(f"{module}.{names.block_scale} is {tensors[names.block_scale][0]}, not F8_E4M3")
        global_shape = tensors[names.global_scale][1]
        if torch.Size(global_shape).numel() != 1:
            raise QuantizationError(f"{module}.{names.global_scale} has shape {global_shape}; it must be one number")
        found.add(canonical)
    return found


def _row_scale(divides: bool, rows: int):
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        value = tensor.float().reshape(1)
        return (1.0 / value if divides else value).expand(rows)

    return convert


def _nvfp4_targets(
    module: str, weight: NVFP4Weight, rows: slice | None, index: int | None, num_rows: int, config: NVFP4Config
) -> dict[str, WeightTarget]:
    """Targets of one checkpoint linear's packed tensors: ``weight``'s ``[index][rows]``."""
    names = config.names
    return {
        f"{module}.{names.packed}": WeightTarget(weight.packed, rows, index),
        f"{module}.{names.block_scale}": WeightTarget(weight.scales, rows, index),
        f"{module}.{names.global_scale}": WeightTarget(
            weight.row_scales, rows, index, _row_scale(names.global_divides, num_rows)
        ),
    }


def _replace(model: nn.Module, param: nn.Parameter, weight: nn.Module) -> None:
    qualified = next(n for n, p in model.named_parameters() if p is param)
    owner_name, _, attribute = qualified.rpartition(".")
    owner = model.get_submodule(owner_name)
    delattr(owner, attribute)
    setattr(owner, attribute, weight)


def _packed_targets(
    weight: NVFP4Weight, parts: list[tuple[str, WeightTarget]], config: NVFP4Config, first_row: int = 0
) -> dict[str, WeightTarget]:
    """Targets of the packed tensors of ``parts`` (checkpoint linears) in ``weight``, whose rows
    start at the parameter's row ``first_row``."""
    targets = {}
    for name, target in parts:
        rows = None if target.rows is None else slice(target.rows.start - first_row, target.rows.stop - first_row)
        count = target.destination().shape[0]
        targets.update(_nvfp4_targets(name.removesuffix(".weight"), weight, rows, target.index, count, config))
    return targets


def _split(
    param: nn.Parameter,
    parts: list[tuple[str, WeightTarget]],
    quantized: set[str],
    config: NVFP4Config,
    device: torch.device,
) -> tuple[SplitWeight, dict[str, WeightTarget]]:
    """A fused 2-D weight whose parts are partly quantized, as runs of packed and dense rows (a part
    missing from the checkpoint is a dense run, which loading then reports unfilled)."""
    ordered = sorted(parts, key=lambda part: part[1].rows.start)
    runs: list[list[tuple[str, WeightTarget]]] = []
    for part in ordered:
        is_packed = part[0].removesuffix(".weight") in quantized
        if runs and (runs[-1][0][0].removesuffix(".weight") in quantized) == is_packed:
            runs[-1].append(part)
        else:
            runs.append([part])
    pieces: list[nn.Module | nn.Parameter] = []
    targets: dict[str, WeightTarget] = {}
    for run in runs:
        first, last = run[0][1].rows.start, run[-1][1].rows.stop
        if run[0][0].removesuffix(".weight") in quantized:
            piece = NVFP4Weight((last - first, param.shape[1]), device)
            targets.update(_packed_targets(piece, run, config, first))
        else:
            piece = nn.Parameter(torch.empty(last - first, param.shape[1], dtype=param.dtype, device=device), requires_grad=False)
            targets.update({
                n: dataclasses.replace(t, param=piece, rows=slice(t.rows.start - first, t.rows.stop - first))
                for n, t in run
            })
        pieces.append(piece)
    return SplitWeight(pieces), targets


def plan_nvfp4(
    model: nn.Module,
    targets: dict[str, WeightTarget],
    files: list[Path],
    config: NVFP4Config,
    device: torch.device | None = None,
) -> NVFP4Load:
    """Replace the parameters the checkpoint quantized with :class:`NVFP4Weight` s (or, for fused
    weights with dense parts, :class:`SplitWeight` s) and return the targets of the tensors they hold
    (every other target unchanged). With ``device``, parameters left on ``meta`` are allocated there."""
    headers = _headers(files)
    quantized = quantized_modules(headers, config)
    present = {canonical_name(f"{module}.{suffix}") for module, tensors in headers.items() for suffix in tensors}
    return _plan(model, targets, quantized, present, config, device)


# 2-D parameters that are not linears: no producer quantizes them.
_NOT_LINEAR = frozenset({"embed_tokens", "conv1d", "ngram_embedding"})


def checkpoint_module(canonical: str) -> str:
    """The module name a text-only checkpoint stores ``canonical`` under (``model.layers.0.x``,
    ``lm_head``): what a quantization config's patterns are written against."""
    return canonical if canonical.split(".")[0] == "lm_head" else f"model.{canonical}"


def dummy_quantized_modules(targets: dict[str, WeightTarget], config: NVFP4Config) -> set[str]:
    """The canonical names of the linears a checkpoint of ``config`` would store as NVFP4: every
    linear weight (per expert for the routed experts) the config selects; a ``QuantizationError``
    for a selected one whose input dim is not a multiple of the group size."""
    quantized = set()
    for name, target in targets.items():
        module = name.removesuffix(".weight")
        if module == name or _NOT_LINEAR.intersection(module.split(".")) or target.param.dim() not in (2, 3):
            continue
        if target.destination().dim() != 2 or not config.quantizes(checkpoint_module(module)):
            continue
        cols = target.destination().shape[1]
        if cols % GROUP_SIZE:
            raise QuantizationError(
                f"{checkpoint_module(module)} has {cols} input columns, not a multiple of the group size {GROUP_SIZE}: "
                f"add it to {config.exclusion_field}"
            )
        quantized.add(module)
    return quantized


def plan_dummy_nvfp4(
    model: nn.Module, targets: dict[str, WeightTarget], config: NVFP4Config, device: torch.device
) -> NVFP4Load:
    """``plan_nvfp4`` without a checkpoint: the linears ``config`` selects become packed weights on
    ``device`` (to be filled with random codes and scales), the rest dense parameters there."""
    # The names such a checkpoint stores: a parameter's parts where it has any (the per-expert
    # linears of released checkpoints, not the fused ``experts.gate_up_proj`` alias).
    parted = {id(t.param) for t in targets.values() if _is_part(t)}
    present = {name for name, t in targets.items() if _is_part(t) or id(t.param) not in parted}
    return _plan(model, targets, dummy_quantized_modules(targets, config), present, config, device)


def _is_part(target: WeightTarget) -> bool:
    return target.index is not None or target.rows is not None


def _plan(
    model: nn.Module,
    targets: dict[str, WeightTarget],
    quantized: set[str],
    present: set[str],
    config: NVFP4Config,
    device: torch.device | None,
) -> NVFP4Load:
    by_param: dict[int, list[tuple[str, WeightTarget]]] = defaultdict(list)
    for name, target in targets.items():
        by_param[id(target.param)].append((name, target))
    load = NVFP4Load(dict(targets))
    for module in quantized:
        load.unused.update(f"{module}.{suffix}" for suffix in config.names.unused)
    for parts in by_param.values():
        # zero rows: never in a checkpoint, kept dense (a split weight's last run)
        stored = [(n, t) for n, t in parts if n in present or n.removesuffix(".weight") in quantized or t.zero]
        packed = [(n, t) for n, t in stored if n.endswith(".weight") and n.removesuffix(".weight") in quantized]
        if not packed:
            continue
        param = parts[0][1].param
        where = device if param.is_meta and device is not None else param.device  # offloaded experts: host
        if len(packed) == len(stored) and param.dim() in (2, 3):
            weight: nn.Module = NVFP4Weight(param.shape, where)
            new_targets = _packed_targets(weight, packed, config)
        elif param.dim() == 2 and all(t.rows is not None for _, t in parts):
            weight, new_targets = _split(param, parts, quantized, config, where)
        else:
            dense = [name for name, _ in stored if name.removesuffix(".weight") not in quantized]
            raise QuantizationError(
                f"{packed[0][0].removesuffix('.weight')} is stored as NVFP4 but FreeToken fuses it with "
                f"{', '.join(dense[:3])}, stored dense (quantize all of them or none)"
            )
        _replace(model, param, weight)
        for name, _ in parts:
            del load.targets[name]
        load.targets.update(new_targets)
    for module in model.modules():
        if isinstance(module, OffloadedExperts):  # one span an expert, before the targets are filled
            module.place_span()
    if device is not None and device.type != "meta":
        moved = materialize(model, device)
        load.targets = {n: dataclasses.replace(t, param=moved.get(id(t.param), t.param)) for n, t in load.targets.items()}
    return load


def materialize(model: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Allocate (uninitialised) on ``device`` every parameter still on ``meta``; returns
    ``{id(old parameter): new parameter}`` (a parameter shared by two modules stays shared)."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            if id(param) not in moved:
                moved[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
            setattr(module, name, moved[id(param)])
    return moved
