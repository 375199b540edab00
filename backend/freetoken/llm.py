"""The offline API, vLLM-style: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from freetoken.config import EngineConfig
from freetoken.core import RequestOutput, SamplingParams
from freetoken.runtime import Prompt, Runtime

PromptInput = str | dict[str, Any]


def _prompt_of(item: PromptInput) -> Prompt:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and "prompt_token_ids" in item:
        return list(item["prompt_token_ids"])
    if isinstance(item, dict) and "prompt" in item:
        return item["prompt"]
    raise TypeError(f"a prompt is a str or a dict with 'prompt_token_ids' or 'prompt', got {type(item).__name__}")


class LLM:
    """Loads a model and generates synchronously. Every keyword is an ``EngineConfig`` field,
    named like its CLI flag (``max_prefill_length`` <-> ``--max-prefill-length``)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        unknown = set(options) - set(EngineConfig.option_names())
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **options)
        self.runtime = Runtime(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; one SamplingParams for all, or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        order: dict[str, int] = {}
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            request_id = f"offline-{next(self._ids)}"
            request = self.runtime.make_request(request_id, _prompt_of(prompt), dataclasses.replace(params))
            self.runtime.submit(request)
            order[request_id] = index
        results: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as progress:
            while self.runtime.has_work:
                for output in self.runtime.step():
                    if output.finished:
                        results[order[output.request_id]] = output
                        self.runtime.forget(output.request_id)
                        progress.update(1)
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptInput] = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix: the KV pages and state snapshots go back to the pools."""
        self.runtime.reset_prefix_cache()

    def prompt_logits(self, prompt: Prompt) -> torch.Tensor:
        """float32 logits after every prompt position ``[len, vocab]``, computed in prefill chunks
        as a request would be (for checks against a reference)."""
        return self.runtime.prompt_logits(self.runtime.tokenize(prompt))
