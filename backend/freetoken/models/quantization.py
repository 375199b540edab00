"""NVFP4 quantization configs: which linears a checkpoint quantized, and where its producer keeps
their tensors.

Two producers write the same numbers (e2m1 codes, e4m3 scales per 16 input columns, one float32
scale per tensor) under different names and conventions:

- **ModelOpt** (``hf_quant_config.json``'s ``quantization``, or ``config.json``'s
  ``quantization_config`` with ``quant_method: modelopt``): ``weight`` (uint8), ``weight_scale``,
  ``weight_scale_2`` (multiplies), ``input_scale`` (W4A4 only). Unquantized modules are listed in
  ``exclude_modules`` (``ignore`` in ``config.json``) as exact names or ``fnmatch`` patterns.
- **compressed-tensors** (``quant_method: compressed-tensors``, format ``nvfp4-pack-quantized``):
  ``weight_packed``, ``weight_scale``, ``weight_global_scale`` (divides: it is ``1 / weight_scale_2``),
  ``input_global_scale``. Modules are chosen by ``config_groups.*.targets`` minus ``ignore``:
  ``re:`` regexes (``re.match``), exact names, or the class name ``Linear``.

Activations are not quantized here (Hopper has no FP4 tensor cores): W4A4's input scales are unused.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.models.checkpoint import CheckpointError

GROUP_SIZE = 16
HF_QUANT_CONFIG = "hf_quant_config.json"
CT_FORMAT = "nvfp4-pack-quantized"
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")


class QuantizationError(CheckpointError):
    pass


@dataclass(frozen=True)
class NVFP4Names:
    """A producer's tensor names for one quantized linear (suffixes after the module name)."""

    producer: str
    packed: str
    global_scale: str
    global_divides: bool
    unused: tuple[str, ...]
    block_scale: str = "weight_scale"


MODELOPT = NVFP4Names("modelopt", "weight", "weight_scale_2", False, ("input_scale",))
COMPRESSED_TENSORS = NVFP4Names("compressed-tensors", "weight_packed", "weight_global_scale", True, ("input_global_scale",))


@dataclass(frozen=True)
class NVFP4Config:
    """A parsed NVFP4 config: the producer's names, and which checkpoint modules it quantized."""

    names: NVFP4Names
    source: str  # where it was read, for messages
    exclusion_field: str
    _selects: Callable[[str], bool]

    def quantizes(self, module: str) -> bool:
        """Whether the config quantizes the linear ``module`` (its full checkpoint name)."""
        return self._selects(module)


def read_quantization(model_dir: str | Path, config: Any) -> NVFP4Config | None:
    """The checkpoint's NVFP4 config, ``None`` for an unquantized checkpoint; a ``QuantizationError``
    naming the field for anything FreeToken cannot load."""
    hf_quant = Path(model_dir) / HF_QUANT_CONFIG
    if hf_quant.exists():
        try:
            section = json.loads(hf_quant.read_text())["quantization"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise QuantizationError(f"{hf_quant} has no readable 'quantization' section: {exc}") from exc
        return _modelopt(section, f"{HF_QUANT_CONFIG} quantization", "exclude_modules")
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method == "modelopt":
        field = "exclude_modules" if "exclude_modules" in qc else "ignore"
        return _modelopt(qc, "config.json quantization_config", field)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, "config.json quantization_config")
    raise QuantizationError(
        f"config.json quantization_config.quant_method is {method!r}; FreeToken loads NVFP4 checkpoints "
        "of quant_method 'modelopt' or 'compressed-tensors'"
    )


def _modelopt(section: dict, source: str, exclusion_field: str) -> NVFP4Config:
    algo = section.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise QuantizationError(f"{source}.quant_algo is {algo!r}; FreeToken loads {' and '.join(MODELOPT_ALGOS)}")
    group_size = section.get("group_size")
    field = "group_size"
    if group_size is None:  # config.json form: the group size is in the config group's weights
        for name, group in (section.get("config_groups") or {}).items():
            group_size, field = (group.get("weights") or {}).get("group_size"), f"config_groups.{name}.weights.group_size"
    if group_size != GROUP_SIZE:
        raise QuantizationError(f"{source}.{field} is {group_size!r}; NVFP4 needs {GROUP_SIZE}")
    patterns = list(section.get(exclusion_field) or [])

    def selects(module: str) -> bool:
        return not any(fnmatch.fnmatchcase(module, p) for p in patterns)

    return NVFP4Config(MODELOPT, source, f"{source}.{exclusion_field}", selects)


def _compressed_tensors(qc: dict, source: str) -> NVFP4Config:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(f"{source}.quantization_status is {status!r}; only 'compressed' checkpoints hold packed weights")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise QuantizationError(f"{source}.config_groups is empty")
    targets: list[str] = []
    for name, group in groups.items():
        where = f"{source}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != CT_FORMAT:
            raise QuantizationError(f"{where}.format is {fmt!r}; FreeToken loads {CT_FORMAT!r}")
        weights = group.get("weights") or {}
        expected = {"num_bits": 4, "type": "float", "group_size": GROUP_SIZE, "strategy": "tensor_group", "symmetric": True}
        for key, value in expected.items():
            if weights.get(key, value) != value:
                raise QuantizationError(f"{where}.weights.{key} is {weights.get(key)!r}; NVFP4 needs {value!r}")
        targets += group.get("targets") or []
    ignore = list(qc.get("ignore") or [])

    def selects(module: str) -> bool:
        return any(_ct_match(module, t) for t in targets) and not any(_ct_match(module, i) for i in ignore)

    return NVFP4Config(COMPRESSED_TENSORS, source, f"{source}.ignore", selects)


def _ct_match(module: str, target: str) -> bool:
    """compressed-tensors' ``match_name`` for a linear module: ``re:`` prefix regex, the class
    ``Linear``, or the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)
