"""Loading the tokenizer that belongs to a model directory."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a missing or broken tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
