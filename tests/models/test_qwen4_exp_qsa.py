"""The tokens QSA lets each query attend to equal those of transformers' reference indexer, for every
query of a chunked prefill and of the decode steps after it, in every indexed-attention layer."""

from __future__ import annotations

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.layers.qsa_indexer import QSAIndexer
from oracle import PAGE_SIZE, Case, checkpoint, random_prompts, reference_model

NEW_TOKENS = 12


def _reference_selections(shape: str, prompt: list[int]) -> dict[int, dict[int, set[int]]]:
    """``{layer: {query position: selected token positions}}`` from transformers' indexer during generate()."""
    model = reference_model(checkpoint(Case("qwen4_exp", shape)))
    found: dict[int, dict[int, set[int]]] = {}

    def record(module, args, output):
        mask = output[0, 0]  # [L, kv]
        length = mask.shape[1]
        rows = found.setdefault(module.layer_idx, {})
        for row, position in enumerate(range(length - mask.shape[0], length)):
            rows[position] = set(torch.nonzero(mask[row]).flatten().tolist())

    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, Qwen4ExpTextQSAIndexer)]
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.shape[1] == len(prompt) + NEW_TOKENS, "the reference stopped early; pick another prompt"
    return found


def _engine_selections(shape: str, prompt: list[int], max_prefill_length: int) -> dict[int, dict[int, set[int]]]:
    llm = LLM(
        model=str(checkpoint(Case("qwen4_exp", shape))),
        dtype="float32",
        device="cpu",
        max_prefill_length=max_prefill_length,
        page_size=PAGE_SIZE,
    )
    model = llm.runtime.engine.model
    found: dict[int, dict[int, set[int]]] = {}
    for layer_idx, layer in enumerate(model.layers):
        indexer = getattr(layer.mixer, "indexer", None)
        if isinstance(indexer, QSAIndexer):
            indexer.select = _recording(indexer, found.setdefault(layer_idx, {}))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return found


def _recording(indexer: QSAIndexer, rows: dict[int, set[int]]):
    select = indexer.select
    ratio = indexer.compress_ratio

    def wrapped(projected, batch, token_request, max_blocks):
        selected = select(projected, batch, token_request, max_blocks)
        for position, blocks in zip(batch.positions.tolist(), selected.tolist()):
            tokens = {b * ratio + i for b in blocks if b >= 0 for i in range(ratio)}
            tokens |= set(range((position + 1) // ratio * ratio, position + 1))
            rows[position] = tokens
        return selected

    return wrapped


@pytest.mark.parametrize("shape", ["blocks_of_a_page", "blocks_within_pages", "blocks_across_pages"])
def test_selected_tokens_equal_reference_indexer(shape):
    prompt = random_prompts(2, seed=5)[0]
    want = _reference_selections(shape, prompt)
    got = _engine_selections(shape, prompt, max_prefill_length=16)
    assert set(got) == set(want)
    for layer, rows in want.items():
        assert set(got[layer]) == set(rows) == set(range(len(prompt) + NEW_TOKENS - 1))
        for position, tokens in rows.items():
            assert got[layer][position] == tokens, f"layer {layer}, query at {position}"
        sparse_queries = sum(len(tokens) < position + 1 for position, tokens in rows.items())
        assert sparse_queries >= 20, f"layer {layer}: only {sparse_queries} queries dropped tokens"
