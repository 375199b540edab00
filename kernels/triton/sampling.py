"""Triton token sampling: greedy, temperature, top-k, top-p, min-p, the reference's counter-based RNG.

One program per request row, a few passes over the vocabulary and no sort:

1. the row's maximum (and greedy argmax); greedy rows stop here;
2. the softmax denominator;
3. when top-k or top-p is on, a 16-ary search over the bit patterns of the (non-negative float32)
   probabilities for the thresholds: top-k keeps ``p >= τ_k``, the smallest value with fewer than
   ``k`` probabilities above it (the k-th largest); top-p keeps ``p >= τ_p``, the smallest value
   whose strictly-larger probabilities sum below ``top_p`` (the reference's "mass before < top_p"
   on the sorted list). Each pass tests 15 candidates per filter and narrows the interval 16-fold,
   so about 8 passes resolve a float32;
4. the exponential race ``argmax p_i / -log(u_i)`` over the kept tokens, with ``u_i`` the same hash
   of ``(seed, step, token)`` as the reference (``freetoken.kernels.sampling.uniform_noise``).

Differences from the torch reference: the kept set is decided by thresholds, so tokens tied with
the boundary probability are all kept (a sort keeps an arbitrary subset of them), and the masses
are summed in another order, which moves the top-p boundary only when ``top_p`` is within float32
rounding of a partial sum. Otherwise the chosen token is the reference's, bit for bit in the noise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import INTERPRETED, arrive, device_function, new_empty, pow2, zeroed_counters

_PROBES = 16  # candidates per filter and pass, including one unused slot (a power of two)


@device_function
def _hash32(x):
    """The reference's ``hash32`` on uint32 (wrapping multiplies are its ``& 0xFFFFFFFF``)."""
    x = x ^ (x >> 17)
    x = x * 0x6B5F0E2D
    x = x ^ (x >> 11)
    x = x * 0x4C8E5A27
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    x = x ^ (x >> 14)
    return x


@device_function
def _narrow(lo, hi, probes, holds):
    """New ``[lo, hi]`` for the smallest bit pattern whose predicate holds (it holds at ``hi``),
    given the predicate at ``probes`` (``lo`` is one of them, so every pass makes progress)."""
    new_hi = tl.min(tl.where(holds, probes, hi), 0)
    new_lo = tl.max(tl.where(holds, lo, probes + 1), 0)
    return new_lo, new_hi


@triton.jit
def _sample_kernel(
    logits_ptr, l_st, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, out_ptr,
    vocab,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PROBES: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * l_st
    temperature = tl.load(temp_ptr + row)
    t = tl.where(temperature > 0, temperature, 1.0)
    offs = tl.arange(0, BLOCK)
    # Pass 1: maxima of the logits (greedy) and of logits / temperature (divided, as the reference).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        i = start + offs
        x = tl.load(base + i, mask=i < vocab, other=float("-inf"))
        better = x > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, x, best)
        m = tl.maximum(m, x / t)
    top = tl.max(best, 0)
    greedy = tl.min(tl.where(best == top, best_i, 2147483647), 0)
    if temperature <= 0:
        tl.store(out_ptr + row, greedy.to(tl.int64))
    else:
        m_row = tl.max(m, 0)
        # Pass 2: the softmax denominator.
        denom = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            i = start + offs
            x = tl.load(base + i, mask=i < vocab, other=float("-inf"))
            denom += tl.exp(x / t - m_row)
        denom_row = tl.sum(denom, 0)
        p_max = 1.0 / denom_row
        top_k = tl.load(topk_ptr + row)
        top_p = tl.load(topp_ptr + row)
        min_p = tl.load(minp_ptr + row)
        # Pass 3: thresholds, as bit patterns of float32 probabilities in [0, p_max].
        max_bits = p_max.to(tl.int32, bitcast=True)
        k_lo = max_bits * 0
        k_hi = tl.where((top_k > 0) & (top_k < vocab), max_bits, 0)
        p_lo = max_bits * 0
        p_hi = tl.where(top_p < 1.0, max_bits, 0)
        s = tl.arange(0, PROBES)
        soffs = tl.arange(0, SEARCH_BLOCK)
        while (k_lo < k_hi) | (p_lo < p_hi):
            k_probe = (k_lo + ((k_hi - k_lo).to(tl.int64) * s // PROBES)).to(tl.int32)
            p_probe = (p_lo + ((p_hi - p_lo).to(tl.int64) * s // PROBES)).to(tl.int32)
            k_thr = k_probe.to(tl.float32, bitcast=True)
            p_thr = p_probe.to(tl.float32, bitcast=True)
            count = tl.zeros([PROBES], tl.int32)
            mass = tl.zeros([PROBES], tl.float32)
            for start in range(0, vocab, SEARCH_BLOCK):
                i = start + soffs
                x = tl.load(base + i, mask=i < vocab, other=float("-inf"))
                p = tl.exp(x / t - m_row) / denom_row
                count += tl.sum((p[:, None] > k_thr[None, :]).to(tl.int32), 0)
                mass += tl.sum(tl.where(p[:, None] > p_thr[None, :], p[:, None], 0.0), 0)
            k_lo, k_hi = _narrow(k_lo, k_hi, k_probe, count < top_k)
            p_lo, p_hi = _narrow(p_lo, p_hi, p_probe, mass < top_p)
        threshold = tl.maximum(tl.maximum(k_hi.to(tl.float32, bitcast=True), p_hi.to(tl.float32, bitcast=True)),
                               min_p * p_max)
        threshold = tl.minimum(threshold, p_max)  # the most likely token is always kept
        # Pass 4: the exponential race among the kept tokens.
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        row_key = _hash32(_hash32(_hash32((step & 0xFFFFFFFF).to(tl.uint32)) ^ (seed & 0xFFFFFFFF).to(tl.uint32))
                          ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        race_best = tl.full([BLOCK], -2.0, tl.float32)
        race_i = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(0, vocab, BLOCK):
            i = start + offs
            x = tl.load(base + i, mask=i < vocab, other=float("-inf"))
            p = tl.exp(x / t - m_row) / denom_row
            bits = _hash32(row_key ^ _hash32(i.to(tl.uint32)))
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            race = tl.where((p >= threshold) & (i < vocab), p / -tl.log(u), -1.0)
            better = race > race_best
            race_i = tl.where(better, i, race_i)
            race_best = tl.where(better, race, race_best)
        winner = tl.max(race_best, 0)
        tl.store(out_ptr + row, tl.min(tl.where(race_best == winner, race_i, 2147483647), 0).to(tl.int64))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    batch, vocab = logits.shape
    if logits.dtype != torch.float32:
        raise ValueError(f"sample_tokens needs float32 logits, got {logits.dtype}")
    for name, column in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p),
                         ("seeds", seeds), ("steps", steps)):
        if column.shape != (batch,):
            raise ValueError(f"sample_tokens: {name} has shape {tuple(column.shape)}, expected ({batch},)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = new_empty((batch,), torch.int64, logits.device)
    if batch:
        _sample_kernel[(batch,)](
            logits, logits.stride(0),
            temperature.float().contiguous(), top_k.int().contiguous(), top_p.float().contiguous(),
            min_p.float().contiguous(), seeds.long().contiguous(), steps.long().contiguous(), out,
            vocab,
            BLOCK=min(pow2(vocab), 1024), SEARCH_BLOCK=min(pow2(vocab), 256), PROBES=_PROBES,
            num_warps=8,
        )
    return out


# The greedy step's launch: a program scans this many logits of its row (16 KB of float32: a 248k
# vocabulary is 61 programs a row, where ``_sample_kernel`` streams the row from one program).
GREEDY_SPLIT = 4096
_GREEDY_BLOCK = 1024


@triton.jit
def _greedy_kernel(
    logits_ptr, l_st, slots_ptr, last_ptr, counts_ptr, c_st, nout_ptr, nout_st, out_ptr,
    part_v_ptr, part_i_ptr, count_ptr, vocab, splits,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    """Grid (row, split): each program the maximum of its ``SPLIT`` logits (the lowest id among
    equal ones), stored as a partial; the last of a row's programs to arrive takes the partials'
    maximum (splits in id order: the lowest id again), stores the token and books it in the row's
    slot: the last-token pool, the output counts and the output counter (atomics: slots repeat)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * l_st
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    first = split * SPLIT
    for start in range(first, first + SPLIT, BLOCK):
        i = start + offs
        x = tl.load(base + i, mask=i < vocab, other=float("-inf"))
        better = x > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, x, best)
    top = tl.max(best, 0)
    tl.store(part_v_ptr + row * splits + split, top)
    tl.store(part_i_ptr + row * splits + split, tl.min(tl.where(best == top, best_i, 2147483647), 0))
    if arrive(count_ptr + row, splits):
        s = tl.arange(0, SPLITS_P2)
        s_ok = s < splits
        v = tl.load(part_v_ptr + row * splits + s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        ids = tl.load(part_i_ptr + row * splits + s, mask=s_ok, other=2147483647, cache_modifier=".cg")
        token = tl.min(tl.where(v == tl.max(v, 0), ids, 2147483647), 0)
        token = tl.where(token < vocab, token, 0).to(tl.int64)  # no finite logit: token 0, as argmax (never out of range)
        tl.store(out_ptr + row, token)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        tl.store(last_ptr + slot, token)
        tl.atomic_add(counts_ptr + slot * c_st + token, 1)
        tl.atomic_add(nout_ptr + slot * nout_st, 1)


def greedy_sample_into_slots_tiled(
    logits: torch.Tensor, slots: torch.Tensor, last_token: torch.Tensor, output_counts: torch.Tensor,
    num_outputs: torch.Tensor, split: int,
) -> torch.Tensor:
    """``greedy_sample_into_slots`` with ``split`` logits a program (a power of two, at least the block)."""
    batch, vocab = logits.shape
    if logits.dtype != torch.float32:
        raise ValueError(f"greedy_sample_into_slots needs float32 logits, got {logits.dtype}")
    if slots.shape != (batch,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"greedy_sample_into_slots: slots must be int32 or int64 ({batch},), got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if output_counts.dim() != 2 or output_counts.shape[1] != vocab or output_counts.stride(1) != 1:
        raise ValueError(f"greedy_sample_into_slots: output_counts must be [slots, {vocab}] with unit column stride, "
                         f"got {tuple(output_counts.shape)}")
    if last_token.dtype != torch.int64 or num_outputs.dtype != torch.int64 or output_counts.dtype != torch.int32:
        raise ValueError("greedy_sample_into_slots: last_token and num_outputs must be int64, output_counts int32")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = new_empty((batch,), torch.int64, logits.device)
    if batch:
        block = min(_GREEDY_BLOCK, split, pow2(vocab))
        splits = triton.cdiv(vocab, split)
        part_v = new_empty((batch, splits), torch.float32, logits.device)
        part_i = new_empty((batch, splits), torch.int32, logits.device)
        _greedy_kernel[(batch, splits)](
            logits, logits.stride(0), slots.contiguous(), last_token, output_counts, output_counts.stride(0),
            num_outputs, num_outputs.stride(0), out, part_v, part_i,
            zeroed_counters(logits.device, "greedy_sample", batch), vocab, splits,
            SPLIT=split, BLOCK=block, SPLITS_P2=pow2(splits), num_warps=4,
        )
    return out


def greedy_sample_into_slots(
    logits: torch.Tensor,
    slots: torch.Tensor,
    last_token: torch.Tensor,
    output_counts: torch.Tensor,
    num_outputs: torch.Tensor,
) -> torch.Tensor:
    # Under the interpreter, whose cost is per program: one program a row.
    split = pow2(logits.shape[-1], _GREEDY_BLOCK) if INTERPRETED else GREEDY_SPLIT
    return greedy_sample_into_slots_tiled(logits, slots, last_token, output_counts, num_outputs, split)
