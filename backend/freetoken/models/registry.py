"""Which model class serves which checkpoint architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from transformers import PretrainedConfig

from freetoken.models.base import CausalLM


@dataclass(frozen=True)
class ModelFamily:
    name: str
    build: Callable[[PretrainedConfig, bool], CausalLM]  # (text config, tie_word_embeddings) -> model


def _qwen3_5_moe(text_config: PretrainedConfig, tie: bool) -> CausalLM:
    from freetoken.models.qwen3_5_moe import Qwen3_5MoeModel

    return Qwen3_5MoeModel(text_config, tie)


def _qwen4_exp(text_config: PretrainedConfig, tie: bool) -> CausalLM:
    from freetoken.models.qwen4_exp import Qwen4ExpModel

    return Qwen4ExpModel(text_config, tie)


ARCHITECTURES: dict[str, ModelFamily] = {
    "Qwen3_5MoeForConditionalGeneration": ModelFamily("qwen3_5_moe", _qwen3_5_moe),
    "Qwen3_5MoeForCausalLM": ModelFamily("qwen3_5_moe", _qwen3_5_moe),
    "Qwen4ExpForConditionalGeneration": ModelFamily("qwen4_exp", _qwen4_exp),
    "Qwen4ExpForCausalLM": ModelFamily("qwen4_exp", _qwen4_exp),
}


def family_of(architectures: list[str] | None) -> ModelFamily:
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported model architecture {architectures!r}; FreeToken serves: {', '.join(sorted(ARCHITECTURES))}"
    )


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    """The text decoder's config: ``text_config`` of a multimodal checkpoint, else the config itself."""
    return getattr(config, "text_config", None) or config
