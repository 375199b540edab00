"""Reading a Hugging Face checkpoint directory: its safetensors files and tensor names."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Released multimodal checkpoints keep the text model under model.language_model.; text-only ones under model.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Tensors that belong to other parts of a checkpoint: the vision tower, multi-token prediction.
_SKIPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)")


class CheckpointError(ValueError):
    pass


def shard_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, or the single file."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"shards named in {index} are missing: {', '.join(missing)}")
        return files
    if (root / SINGLE_FILE).exists():
        return [root / SINGLE_FILE]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def canonical_name(name: str) -> str | None:
    """``model.language_model.layers.0.x`` -> ``layers.0.x``; ``None`` for tensors the text model ignores."""
    if _SKIPPED.match(name):
        return None
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def iterate_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` pairs of one shard, read lazily; a corrupt file raises ``CheckpointError``."""
    try:
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read checkpoint shard {path}: {exc}") from exc


def count_tensors(path: Path) -> int:
    try:
        with safe_open(str(path), framework="pt") as shard:
            return len(shard.keys())
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read checkpoint shard {path}: {exc}") from exc
