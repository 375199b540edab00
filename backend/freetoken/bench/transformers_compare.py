"""transformers' ``generate()`` on the same weights, in the same process, for comparison.

The transformers model is built from the text config and every tensor of its state dict copied
from the FreeToken model's parameters through the same checkpoint names the loader uses, so the
two run identical weights (random ones included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from freetoken.models.base import CausalLM
from freetoken.models.checkpoint import canonical_name
from freetoken.models.loader import _fit
from freetoken.models.registry import family_of, text_config_of

CAUSAL_LM_CLASSES = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen4_exp": "Qwen4ExpForCausalLM"}


@torch.no_grad()
def transformers_model_of(model: CausalLM, config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """transformers' text model of ``config`` holding a copy of ``model``'s weights, on its device."""
    import transformers

    family = family_of(getattr(config, "architectures", None))
    model_class = getattr(transformers, CAUSAL_LM_CLASSES[family.name])
    device = model.embed_tokens.device
    with torch.device(device):
        hf_model = model_class._from_config(text_config_of(config), dtype=dtype)
    targets = model.weight_targets()
    unfilled = []
    for name, tensor in hf_model.state_dict().items():
        target = targets.get(canonical_name(name) or "")
        if target is None:
            unfilled.append(name)
            continue
        source = target.destination()
        tensor.copy_(_fit(source, tensor, name, device))
    tied = set(model.tied_weights())
    unfilled = [n for n in unfilled if canonical_name(n) not in tied]
    if unfilled:
        raise ValueError(f"no FreeToken weight for the transformers tensors {unfilled[:5]}")
    return hf_model.eval()


REPEATS = 3


@dataclass(frozen=True)
class TransformersTiming:
    prefill_seconds: float  # generate() of one new token: the prompt's forward and one sample
    total_seconds: float  # generate() of output_len tokens

    def decode_ms_per_step(self, output_len: int) -> float:
        return (self.total_seconds - self.prefill_seconds) / max(1, output_len - 1) * 1e3


def _generate_seconds(model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int) -> float:
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.inference_mode()
def time_transformers(model: PreTrainedModel, prompts: list[list[int]], output_len: int) -> TransformersTiming:
    """Greedy ``generate()`` of equal-length prompts as one batch (no padding): a warm-up, then a
    one-token run (prefill) and an ``output_len`` run, each the fastest of ``REPEATS`` (so host noise
    cannot make their difference, decode per step, come out negative)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor(prompts, dtype=torch.int64, device=device)
    _generate_seconds(model, input_ids, min(2, output_len))
    prefill = min(_generate_seconds(model, input_ids, 1) for _ in range(REPEATS))
    total = min(_generate_seconds(model, input_ids, output_len) for _ in range(REPEATS))
    return TransformersTiming(prefill, total)
