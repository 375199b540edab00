"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness is counter-based: the uniform draw of token ``i`` for a request is a hash of
``(seed, step, i)``, so a seeded request reproduces its tokens whatever else is batched with it,
on any backend. A token is drawn by the exponential race ``argmax_i p_i / E_i`` with
``E_i = −log u_i``, which picks ``i`` with probability ``p_i`` among the tokens the filters keep.

Filters apply in this order to ``softmax(logits / temperature)``: top-k, top-p (the smallest set of
most likely tokens whose mass reaches ``top_p``), min-p (tokens at least ``min_p`` times the most
likely one). ``temperature == 0`` is greedy. ``top_k <= 0`` or ``>= V``, ``top_p == 1`` and
``min_p == 0`` switch a filter off.
"""

from __future__ import annotations

import torch

from freetoken.kernels.dispatch import op

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of them stays inside int64.
_MULTIPLIERS = (0x6B5F0E2D, 0x4C8E5A27, 0x31848BAB)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply rounds) over int64 tensors holding values < 2**32."""
    x = x & _MASK32
    x = x ^ (x >> 17)
    for multiplier, shift in zip(_MULTIPLIERS, (11, 15, 14)):
        x = (x * multiplier) & _MASK32
        x = x ^ (x >> shift)
    return x


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 ``[B, V]`` in (0, 1): the draws of every token for each request's ``(seed, step)``."""
    seeds = seeds.long()
    row_key = hash32(hash32(hash32(steps.long()) ^ (seeds & _MASK32)) ^ ((seeds >> 32) & _MASK32))
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = hash32(row_key[:, None] ^ hash32(token)[None, :])
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """``logits [B, V]`` float32 -> token ids ``[B]`` int64; the other arguments are ``[B]`` per request."""
    greedy = logits.argmax(dim=-1)
    vocab_size = logits.shape[-1]
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / safe_temperature[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k).long()
    keep_sorted = rank < k[:, None]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted &= (mass_before < top_p[:, None]) | (rank == 0)
    keep_sorted &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter_(1, sorted_ids, keep_sorted)
    race = probs / -torch.log(uniform_noise(seeds, steps, vocab_size))
    sampled = race.masked_fill(~keep, -1.0).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


sample_tokens = op("sampling")(sample_tokens_reference)


def greedy_sample_into_slots_reference(
    logits: torch.Tensor,
    slots: torch.Tensor,
    last_token: torch.Tensor,
    output_counts: torch.Tensor,
    num_outputs: torch.Tensor,
) -> torch.Tensor:
    """A step whose every sampled row is greedy, sampled and booked in one op: the argmax of each
    row of ``logits [N, V]`` float32 (the lowest id among equal maxima, as ``sample_tokens`` at
    temperature 0), written into row ``slots [N]`` (int32 or int64) of the sampler's per-slot tables, in
    place: ``last_token [S]`` (the next decode's input), ``output_counts [S, V]`` int32 and
    ``num_outputs [S]`` int64 each incremented (accumulating where slots repeat: padding rows).
    Returns the token ids ``[N]`` int64."""
    token_ids = logits.argmax(dim=-1)
    slots = slots.long()
    last_token.scatter_(0, slots, token_ids)
    ones = torch.ones_like(token_ids)
    output_counts.view(-1).scatter_add_(0, slots * output_counts.shape[1] + token_ids, ones.int())
    num_outputs.scatter_add_(0, slots, ones)
    return token_ids


greedy_sample_into_slots = op("sampling")(greedy_sample_into_slots_reference)
