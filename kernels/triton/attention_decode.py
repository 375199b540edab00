"""Split-KV paged attention for steps whose every request fits one query block (decode), in one launch.

Grid: (request, KV head, split). A program's rows are (query token, query head of the KV head's
group) pairs, so the GQA heads of a KV head share one load of each key block (at Qwen3.5's shape,
8 heads of 256: half the 16 rows of a matrix-unit tile). Each program attends to one range of its
request's keys with an online softmax in float32.

The split plan is derived on the device. The host fixes only the grid's split axis, ``max_splits``,
from the launch size (requests x KV heads, so a CUDA graph captured for a batch size replays for
any context length); every program reads its request's context length and computes how many
splits that context needs (``split_keys`` keys at least each, ``max_splits`` at most) and its own
range. Programs past the plan exit at once. A request that needs one split writes its output
directly, gated.

With several splits, each program stores its normalised partial output and log2-sum-exp in a
workspace and arrives at a counter; the program that brings a counter to its member count is the
last of them to finish and does the merge, so no second launch and no waiting. The merge has two
levels so that no program reads many partials in turn: the last of each ``FAN_IN`` consecutive
splits (a "quad") merges them into the quad's first slot, and the last quad to finish merges the
quads, gates and stores (with at most ``FAN_IN`` splits the first level is the last). The order is
fixed by split index, so the result does not depend on which programs came last. The last
arrival resets its counter to zero, which keeps the counters graph-safe without a memset; they
live in one zero-initialised buffer per device, kept for the process (``_common.zeroed_counters``), so launches
on one device must run in stream order, as the engine's do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import (
    arrive,
    cast,
    device_function,
    dot,
    dot_precision,
    new_empty,
    on_gpu,
    pow2,
    round_as,
    zeroed_counters,
)
from freetoken.kernels.triton.moe_decode import _pdl_available

# Bound of the grid's split axis: at batch 1, 64 splits x 2 KV heads are about one program per
# multiprocessor of an H200. No loop is unrolled over it (the merge reads at most FAN_IN partials,
# then at most MAX_SPLITS / FAN_IN), so it costs no compile time.
MAX_SPLITS = 64
FAN_IN = 4  # partials one merging program combines per level (loaded together where registers allow)


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape: keys per block (``block_n``; ``None``: 64, or 32 for float32 heads wider than
    128, where a 64-key float32 tile of K and V would not fit shared memory), warps (``None``: 4,
    8 in float32, where 4 spill thousands of bytes at head_dim 256 on sm_90), pipeline stages, and
    the fewest keys a split may hold (``split_keys``, rounded up to a whole block; ``None``: one
    block). Three stages let the pipeliner fetch a block's page numbers two blocks ahead and its
    K/V tiles one ahead (with two, the page numbers are loaded synchronously each block) in the
    same shared memory and fewer registers (sm_90, Triton 3.6: 220 vs 242 at bf16, head_dim 256).

    That pipeline keeps one K and one V buffer (sm_90, Triton 3.6): a block's K/V addresses come
    from a load of the same iteration, so the copy of block i + 1 is issued only after block i's
    dots, and a program has one block in flight. ``prefetch_pages`` loads the page numbers a block
    ahead by hand, so the K/V loads depend on no load of their iteration: the pipeliner then
    double-buffers them at 3 stages (``async_wait`` keeps the next block's copy in flight while this
    one is computed; 141 KB of shared memory at 64-key blocks, 75 KB at 32; three buffers at 4
    stages).

    The grid's split axis (``num_splits``) aims at ``programs_per_sm`` programs a multiprocessor:
    the power of two at or above that share (``round_splits_down`` False, e.g. 4 splits at batch 64
    with 2 KV heads on 132 multiprocessors: 512 programs, two waves of 2 a multiprocessor), or the
    largest one whose programs fit it (True: 2 splits, 256 programs).
    ``benchmarks/attention_decode_sweep.py --tune`` / ``--focus`` time the candidates on the GPU."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    split_keys: int | None = None
    prefetch_pages: bool = False
    programs_per_sm: int = 2
    round_splits_down: bool = False

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1:
            raise ValueError(f"DecodeTiles.programs_per_sm must be at least 1, got {self.programs_per_sm}")


# 8 warps: at batch 1, bf16, head_dim 256, 64-key splits, 8 warps against 4 ran 10.99 against 12.77
# us a layer at a 1k context, 11.69 against 16.19 at 1,056 (17 splits: the merge's second level) and
# 15.29 against 17.48 at 4k (graph replays on the H200, docs/benchmarks.md "Session 25").
TILES = DecodeTiles(num_warps=8)
# Launches of at least MANY_PROGRAMS (request, KV head) pairs (64 requests and up at 2 KV heads):
# 8 warps, the page numbers prefetched, and up to 2,048 keys a split, so a 1k-token request is one
# split (the grid's other splits exit at once) and no merge. At 64 x 1k on the H200 the measured
# best (`attention_decode_sweep.py --focus 64 1024`: 64-key blocks, 8 warps, prefetch, one split)
# ran 41.4 us a layer against TILES' 52.3.
MANY_TILES = DecodeTiles(num_warps=8, prefetch_pages=True, split_keys=2048)
MANY_PROGRAMS = 128


def decode_tiles(programs: int) -> DecodeTiles:
    """The launch shape for ``programs`` (request, KV head) pairs."""
    return MANY_TILES if programs >= MANY_PROGRAMS else TILES


def num_splits(q: torch.Tensor, programs: int, tiles: DecodeTiles = TILES) -> int:
    """The grid's split axis for a launch of ``programs`` (request, KV head) pairs: about
    ``tiles.programs_per_sm`` programs a multiprocessor (rounded as ``tiles.round_splits_down``
    says), at most ``MAX_SPLITS``. A host value of the launch size alone; the programs then use as
    many of these splits as their context needs."""
    # Under the interpreter: as if 4 multiprocessors, so the CPU tests exercise the split path.
    processors = _multiprocessors(q.device.index or 0) if on_gpu(q) else 4
    slots = tiles.programs_per_sm * processors
    if tiles.round_splits_down:
        splits = 1 << (max(slots // programs, 1).bit_length() - 1)
    else:
        splits = pow2(triton.cdiv(slots, programs))
    return min(MAX_SPLITS, splits)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@device_function
def _gated_store(o, gate_ptr, g_st, g_sh, out_ptr, tok_rows, head, out_rows, cols, mask, head_dim,
                 HAS_GATE: tl.constexpr):
    """The normalised float32 output ``o`` rounded to the output dtype, times ``sigmoid(gate)``
    rounded to it (the reference's roundings), stored."""
    dtype = out_ptr.dtype.element_ty
    o = round_as(o, dtype)
    if HAS_GATE:
        g = tl.load(gate_ptr + tok_rows[:, None] * g_st + head[:, None] * g_sh + cols[None, :], mask=mask, other=0.0)
        o = o * round_as(tl.sigmoid(g.to(tl.float32)), dtype)
    tl.store(out_ptr + out_rows[:, None] * head_dim + cols[None, :], cast(o, dtype), mask=mask)


@device_function
def _store_partial(part_ptr, lse_ptr, slot, o, lse, out_rows, row_ok, cols, num_rows, BLOCK_D: tl.constexpr):
    """Partial ``slot`` of the group's rows: normalised float32 output and its log2-sum-exp."""
    rows = slot * num_rows + out_rows
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(part_ptr + rows[:, None] * BLOCK_D + cols[None, :], o, mask=row_ok[:, None])


@device_function
def _merge(part_ptr, lse_ptr, out_rows, row_ok, cols, num_rows, first, count, step,
           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS: tl.constexpr, UNROLL: tl.constexpr):
    """Partials ``first, first + step, ...`` (``count <= SLOTS`` of them) combined by their
    log2-sum-exp weights in that order: (normalised output, log2-sum-exp). ``UNROLL`` partials are
    loaded at a time. Loads bypass L1 (``.cg``): other multiprocessors wrote the partials."""
    s = tl.arange(0, SLOTS)
    lse_all = tl.load(lse_ptr + (first + s[None, :] * step) * num_rows + out_rows[:, None],
                      mask=row_ok[:, None] & (s[None, :] < count), other=float("-inf"), cache_modifier=".cg")
    lse_max = tl.max(lse_all, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for i in range(0, count, UNROLL):
        for j in tl.static_range(UNROLL):
            ok = row_ok & (tl.full([BLOCK_M], i + j, tl.int32) < count)
            rows = (first + (i + j) * step) * num_rows + out_rows
            lse = tl.load(lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_ptr + rows[:, None] * BLOCK_D + cols[None, :], mask=ok[:, None], other=0.0,
                           cache_modifier=".cg")
            weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
            acc += part * weight[:, None]
            total += weight
    lse = tl.where(total > 0, lse_max + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
    return acc / tl.where(total > 0, total, 1.0)[:, None], lse


@triton.jit
def _decode_attention_kernel(
    q_ptr, q_st, q_sh,
    k_ptr, v_ptr, c_sp, c_st, c_sh,
    pt_ptr, pt_sb,
    cu_ptr, seq_ptr,
    gate_ptr, g_st, g_sh,
    out_ptr, part_ptr, lse_ptr, count_ptr,
    scale, num_q_heads, num_kv_heads, page_size, head_dim, num_rows, max_splits, split_keys,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    FAN_IN: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # q, the gate and this step's keys are earlier launches' outputs; the split counters
        # were reset by the previous launch's last programs, which the wait also covers
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    context = tl.load(seq_ptr + b)  # the request's keys; its queries are the last q_len of them
    # The split plan of this context: at least split_keys keys a split, at most max_splits splits,
    # whole key blocks each; splits = how many ranges of split_len cover the context.
    splits = tl.minimum(tl.maximum((context + split_keys - 1) // split_keys, 1), max_splits)
    per_split = (context + splits - 1) // splits
    split_len = tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N, 1) * BLOCK_N  # > 0 for an empty row too
    splits = (context + split_len - 1) // split_len
    if (q_len > 0) & (split < splits):
        rows = tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
        pos = context - q_len + tok
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < head_dim
        tok_rows = q_start + tok
        q = tl.load(q_ptr + tok_rows[:, None] * q_st + head[:, None] * q_sh + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, context)
        pages_ptr = pt_ptr + b * pt_sb
        qk_scale = scale * 1.4426950408889634  # softmax in base 2
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if PREFETCH_PAGES:
            n = lo + tl.arange(0, BLOCK_N)
            page_next = tl.load(pages_ptr + n // page_size, mask=n < hi, other=0)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            if PREFETCH_PAGES:
                # The next block's page numbers, loaded a block ahead by hand: this block's K/V
                # addresses then depend on no load of this iteration.
                page = page_next.to(tl.int64)
                n_next = n + BLOCK_N
                page_next = tl.load(pages_ptr + n_next // page_size, mask=n_next < hi, other=0)
            else:
                page = tl.load(pages_ptr + n // page_size, mask=n_ok, other=0).to(tl.int64)
            offs = page * c_sp + (n % page_size) * c_st + kv_head * c_sh
            kv_mask = n_ok[:, None] & col_ok[None, :]
            # V is loaded with K, before the scores need K: both reads are in flight at once.
            k = tl.load(k_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + offs[:, None] + cols[None, :], mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k), PRECISION) * qk_scale
            s = tl.where(n_ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
            m_i = m_new
        out_rows = tok_rows * num_q_heads + head
        mask = row_ok[:, None] & col_ok[None, :]
        gate = (gate_ptr, g_st, g_sh, out_ptr, tok_rows, head, out_rows, cols, mask, head_dim, HAS_GATE)
        if splits == 1:
            _gated_store(acc / l_i[:, None], *gate)
        else:
            # Partial: -inf log-sum-exp where a row saw no key (a query token of a multi-token
            # step whose causal range ends before this split).
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            layout = (out_rows, row_ok, cols, num_rows)
            _store_partial(part_ptr, lse_ptr, split, acc / l_safe[:, None], lse, *layout, BLOCK_D)
            # Two-level merge: the last of each FAN_IN consecutive splits merges them into the
            # slot of their first; the last of those merges the slots 0, FAN_IN, 2 FAN_IN, ...
            # Each level's reads are short, and the order is fixed by split index.
            counters = count_ptr + (b * num_kv_heads + kv_head) * (1 + MAX_SPLITS // FAN_IN)
            first = split // FAN_IN * FAN_IN
            quads = (splits + FAN_IN - 1) // FAN_IN
            if arrive(counters + 1 + split // FAN_IN, tl.minimum(FAN_IN, splits - first)):
                o, lse = _merge(part_ptr, lse_ptr, *layout, first, tl.minimum(FAN_IN, splits - first), 1,
                                BLOCK_M, BLOCK_D, FAN_IN, MERGE_UNROLL)
                if quads == 1:
                    _gated_store(o, *gate)
                else:
                    _store_partial(part_ptr, lse_ptr, first, o, lse, *layout, BLOCK_D)
                    if arrive(counters, quads):
                        o, lse = _merge(part_ptr, lse_ptr, *layout, 0, quads, FAN_IN,
                                        BLOCK_M, BLOCK_D, MAX_SPLITS // FAN_IN, MERGE_UNROLL)
                        _gated_store(o, *gate)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    gate: torch.Tensor | None = None,
    max_splits: int | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """``paged_attention`` (same arguments and result) for steps whose requests all have at most
    ``max_seqlen_q`` new tokens, few enough that a request's rows (tokens x GQA group) fit one
    program's tile. ``max_splits`` overrides the grid's split axis (``num_splits``; at most
    ``MAX_SPLITS``); ``tiles`` the launch shape (``None``: ``decode_tiles``). Callers have checked
    the shapes and made the head dims unit-stride."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_requests = seq_lens.shape[0]
    tiles = tiles or decode_tiles(num_requests * num_kv_heads)
    group = num_q_heads // num_kv_heads
    block_m = pow2(group * max_seqlen_q, 16)
    wide = q.dtype == torch.float32 and head_dim > 128
    block_n = tiles.block_n or (32 if wide else 64)
    if block_n < 16 or block_n != pow2(block_n):
        raise ValueError(f"paged_decode_attention: block_n {block_n} is not a power of two >= 16 (tl.dot's least)")
    split_keys = triton.cdiv(tiles.split_keys or block_n, block_n) * block_n
    splits = max_splits or num_splits(q, num_requests * num_kv_heads, tiles)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode_attention: max_splits {splits} outside 1..{MAX_SPLITS}")
    out = new_empty((num_tokens, num_q_heads, head_dim), q.dtype, q.device)
    block_d = pow2(head_dim)
    # Multi-token steps with many rows: 8 warps once the float32 accumulator passes 8K elements
    # (64 registers a thread at 4 warps), as the varlen kernel's tiles.
    num_warps = 8 if block_m * block_d > 8192 else tiles.num_warps or (8 if q.dtype == torch.float32 else 4)
    # The merge loads FAN_IN partial tiles at once for 16 rows, fewer for more rows (registers:
    # 4 at 128 rows spilled 1 KB a thread, 1 spills 264 B; sm_90, Triton 3.6, bf16 head_dim 256).
    merge_unroll = max(1, FAN_IN * 16 // block_m)
    if splits > 1:
        part = new_empty((splits * num_tokens * num_q_heads, block_d), torch.float32, q.device)
        lse = new_empty((splits * num_tokens * num_q_heads,), torch.float32, q.device)
        counters = zeroed_counters(
            q.device, "attention_decode", num_requests * num_kv_heads * (1 + MAX_SPLITS // FAN_IN)
        )
    else:
        part = lse = counters = out  # never touched: every program's plan is one split
    gate_arg = gate if gate is not None else q
    _decode_attention_kernel[(num_requests, num_kv_heads, splits)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table, page_table.stride(0),
        cu_seqlens_q, seq_lens,
        gate_arg, gate_arg.stride(0), gate_arg.stride(1),
        out, part, lse, counters,
        scale, num_q_heads, num_kv_heads, k_cache.shape[1], head_dim, num_tokens * num_q_heads, splits, split_keys,
        GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype), MAX_SPLITS=MAX_SPLITS,
        FAN_IN=FAN_IN, MERGE_UNROLL=merge_unroll, PREFETCH_PAGES=tiles.prefetch_pages, PDL=_pdl_available(),
        num_warps=num_warps, num_stages=tiles.num_stages, launch_pdl=_pdl_available(),
    )
    return out
