"""The MoE down grouped GEMM in Gluon (Triton 3.6, sm_90) with a warp-specialized schedule: a 1-warp
TMA producer streams K-blocks into a ring of shared-memory stages across tile boundaries, while
consumer warpgroups run ``warpgroup_mma`` and the scattered epilogue.

Same semantics as ``moe.down(h, w2, order, offsets, topk_weights, y, config)`` for the routed case:
``y[order[r]] = bf16(bf16(h[r] @ w2[e].T) * weight[order[r]])`` for the sorted rows ``r`` of expert
``e`` (``moe._down_store``: the accumulator rounded to bf16, times the float32 routing weight,
rounded again). Row tiles from ``moe.tile_map``.

Schedules (``NUM_CONSUMERS`` consumer partitions x ``num_warps`` warps, + the 1-warp producer):
- pingpong (2 x 4): the consumers take alternate items (128 x BLOCK_N output tiles) of the
  program's sequence, each a whole tile (BLOCK_N = 128: a 128-register accumulator). Two "turn"
  mbarriers serialize their main loops (CUTLASS sm90 pingpong's ordering barrier): one's epilogue
  runs under the other's MMAs, and no consumer waits on a ring stage more than one phase ahead
  (mbarrier parity cannot tell phase n from n + 2).
- cooperative (1 x 8): one 8-warp consumer, its two warpgroups splitting the tile's rows (BLOCK_N
  128 or 256); the tensor cores idle during its epilogue while the producer keeps loading.
- single (1 x 4) at two CTAs an SM: the hardware interleaves two CTAs' main loops and epilogues.

Operands: streaming (``chunk=0``) loads each item's h block and w2 block (256 KB per 128 x 128
item, ~2.6 GB L2 -> SM at T=8192, as the Triton kernel). A-stationary (``chunk > 0``) keeps a row
tile's h rows (128 x 512, 128 KB, one buffer per K block) in shared memory over ``chunk`` column
blocks and streams only w2 blocks (~1.4 GB at chunk 16); its A blocks are reloaded block by block
as the last MMAs of the previous unit retire.

``half_tail``: an expert's last row tile of at most BLOCK_M / 2 pairs loads and multiplies only
BLOCK_M / 2 rows (``GemmConfig.half_tail``).

    python3 benchmarks/gluon_down_gemm.py            # T=8192: every variant against moe.down (H100 / H200)
    python3 benchmarks/gluon_down_gemm.py --small    # T=256, E=8: correctness only, also on a 3-program grid
    python3 benchmarks/gluon_down_gemm.py --only "pingpong n128 s4 a-stat"   # variants by name substring

benchmarks/gluon_down_compile.py compiles the variants for sm_90 without a GPU. Gluon kernels do not run
under Triton's interpreter, so this is a measurement, not an engine path (docs/architecture.md).

Measured on an H100 (session 34, docs/benchmarks.md), every variant bit-exact against ``moe.down``:
pingpong 365-372 us against the Triton kernel's 378-379 (2-4% faster); the A-stationary variants no
faster than streaming (the down GEMM is not bound by L2 -> SM traffic); cooperative and single-consumer
schedules 5-40% slower. Requires Triton 3.6's Gluon API (3.9 changed ``warp_specialize``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# Layout helpers (evaluated at compile time)


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """The wgmma accumulator layout of a ``rows x cols`` tile over ``num_warps`` warps: warps along
    M first (16 rows each), the widest instruction N that divides the tile."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if rows > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n = min(256, cols // warps[1])
    while cols % n or n % 8:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.constexpr_function
def _store_layout(cols, num_warps):
    """Rows of ``cols`` bf16 stored as 16-byte vectors, a warp covering whole rows: each warp store
    writes full 128-byte lines of a scattered output row."""
    per_row = min(32, cols // 8)
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


# ----------------------------------------------------------------------------------------------
# The work sequence, identical in every partition. A program takes units pid, pid + G, pid + 2G, ...
# (G programs); a unit is CHUNK consecutive column blocks of one row tile (its "items"), item j of
# the program's sequence (j = v * CHUNK + b for its v-th unit's block b) using B ring positions
# j * KSTEPS .. j * KSTEPS + KSTEPS - 1. Streaming (CHUNK = 1): units are the (row tile, column
# block) pairs grouped as moe._group_index (GROUP_M row tiles over all column blocks).
# A-stationary: units run row tile by row tile (the tiles of an expert, so its weight blocks, close
# together in time), the row tile's h rows loaded once per unit.


@gluon.jit
def _unit(unit, row_tiles, col_blocks, CHUNK: gl.constexpr, GROUP_M: gl.constexpr):
    """(row tile, first column block) of ``unit``."""
    if CHUNK == 1:
        per_group = GROUP_M * col_blocks
        first = (unit // per_group) * GROUP_M
        size = gl.minimum(row_tiles - first, GROUP_M)
        tile = first + (unit % per_group) % size
        col0 = (unit % per_group) // size
    else:
        chunks = col_blocks // CHUNK
        tile = unit // chunks
        col0 = (unit % chunks) * CHUNK
    return tile, col0


@gluon.jit
def _is_half(first, end, HALF_TAIL: gl.constexpr, BLOCK_M: gl.constexpr):
    if HALF_TAIL:
        half = end - first <= BLOCK_M // 2
    else:
        half = first < 0  # never
    return half


@gluon.jit
def _load_a(h_desc, h_half_desc, row, k, bar, buf, half, HALF_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
            EXTRA_BYTES: gl.constexpr):
    """The h rows ``row ..`` at K offset ``k`` into ``buf`` on ``bar`` (expecting ``EXTRA_BYTES`` more: the
    B block of the same stage); a half tile loads only the first BLOCK_M / 2 rows, all the consumer's
    half-tile MMA reads."""
    if HALF_TAIL:
        if half:
            mbarrier.expect(bar, h_half_desc.block_type.nbytes + EXTRA_BYTES)
            tma.async_copy_global_to_shared(h_half_desc, [row, k], bar, buf.slice(0, BLOCK_M // 2))
        else:
            mbarrier.expect(bar, h_desc.block_type.nbytes + EXTRA_BYTES)
            tma.async_copy_global_to_shared(h_desc, [row, k], bar, buf)
    else:
        mbarrier.expect(bar, h_desc.block_type.nbytes + EXTRA_BYTES)
        tma.async_copy_global_to_shared(h_desc, [row, k], bar, buf)


# ----------------------------------------------------------------------------------------------
# Producer: one warp issuing TMA loads. B ring position q uses stage q % STAGES; its n-th fill
# (n = q // STAGES) waits for the n-th release of that stage (empty parity (n & 1) ^ 1: a fresh
# barrier counts as released once, so the first STAGES fills go straight through). Streaming: the
# A block rides in the same stage. A-stationary: the row tile's KSTEPS A blocks have their own
# buffers and barriers (a_ready / a_empty, one per K block, phase = the program's unit count); unit
# v's A block kk is loaded once every consumer has retired its last MMA on unit v - 1's block kk,
# interleaved with the unit's first B blocks, so the reload streams in under the previous unit's
# last MMAs.


@gluon.jit
def _producer(h_desc, h_half_desc, w_desc, a_bufs, b_bufs, ready, empty, a_ready, a_empty, map_ptr, map_tiles,
              hidden, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, KSTEPS: gl.constexpr,
              STAGES: gl.constexpr, GROUP_M: gl.constexpr, HALF_TAIL: gl.constexpr, CHUNK: gl.constexpr,
              A_STATIONARY: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    row_tiles = gl.load(map_ptr + 3 * map_tiles)
    col_blocks = hidden // BLOCK_N
    b_bytes: gl.constexpr = w_desc.block_type.nbytes
    q = 0
    v = 0
    for unit in range(pid, row_tiles * (col_blocks // CHUNK), nprog):
        tile, col0 = _unit(unit, row_tiles, col_blocks, CHUNK, GROUP_M)
        expert = gl.load(map_ptr + tile)
        first = gl.load(map_ptr + map_tiles + tile)
        end = gl.load(map_ptr + 2 * map_tiles + tile)
        half = _is_half(first, end, HALF_TAIL, BLOCK_M)
        for b in range(CHUNK):
            w_row = expert * hidden + (col0 + b) * BLOCK_N
            for kk in gl.static_range(KSTEPS):
                if A_STATIONARY:
                    if b == 0:
                        mbarrier.wait(a_empty.index(kk), (v & 1) ^ 1)
                        _load_a(h_desc, h_half_desc, first, kk * BLOCK_K, a_ready.index(kk), a_bufs.index(kk), half,
                                HALF_TAIL, BLOCK_M, 0)
                s = q % STAGES
                mbarrier.wait(empty.index(s), ((q // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if A_STATIONARY:
                    mbarrier.expect(bar, b_bytes)
                else:
                    _load_a(h_desc, h_half_desc, first, kk * BLOCK_K, bar, a_bufs.index(s), half, HALF_TAIL, BLOCK_M,
                            b_bytes)
                tma.async_copy_global_to_shared(w_desc, [w_row, kk * BLOCK_K], bar, b_bufs.index(s))
                q += 1
        v += 1


# ----------------------------------------------------------------------------------------------
# Consumers


@gluon.jit
def _opaque_zero(x):
    """0, computed by an asm statement the compiler cannot see through or hoist. Adding it to the
    ring position and A block index of each K step keeps their MMA descriptors from being hoisted out
    of the loops into registers (where the stage of each static K step is known: A-stationary, or
    KSTEPS a multiple of STAGES; 8 K steps x 4 MMAs x 2 operands x 64 bits) and spilled."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, a_ready, a_empty, q0, v, last, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr, A_STATIONARY: gl.constexpr,
              num_warps: gl.constexpr):
    """Issues the item's KSTEPS async wgmmas on B ring positions q0 .. q0 + KSTEPS - 1 (``ROWS`` rows of
    each A block), one MMA in flight: a stage is released as soon as the MMA reading it has retired
    (A-stationary: on the unit's ``last`` item of this consumer, the A block too). Returns with the
    last MMA still in flight (``_retire``)."""
    layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, num_warps)
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
    for kk in gl.static_range(KSTEPS):
        zero = _opaque_zero(q0)
        q = q0 + kk + zero
        s = q % STAGES
        if A_STATIONARY:
            mbarrier.wait(a_ready.index(kk), v & 1)
            a = a_bufs.index(kk + zero)
        else:
            a = a_bufs.index(s)
        mbarrier.wait(ready.index(s), (q // STAGES) & 1)
        if ROWS != a_bufs.shape[1]:
            a = a.slice(0, ROWS)
        acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
        if kk > 0:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((q - 1) % STAGES))
            if A_STATIONARY:
                mbarrier.arrive(a_empty.index(kk - 1), pred=last)
    return acc


@gluon.jit
def _retire(acc, empty, a_empty, q0, last, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
            A_STATIONARY: gl.constexpr):
    """Waits for the item's last MMA and releases its stage (and A block)."""
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(empty.index((q0 + KSTEPS - 1) % STAGES))
    if A_STATIONARY:
        mbarrier.arrive(a_empty.index(KSTEPS - 1), pred=last)
    return acc


@gluon.jit
def _epilogue(acc, first, end, col_block, order_ptr, topk_w_ptr, y_ptr, hidden, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """``y[order[r], cols] = bf16(bf16(acc) * weight)``: weighted in the accumulator's layout (a
    thread's few rows), then converted (through shared memory) to whole-row 16-byte stores."""
    mma_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, num_warps)
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
    row_ok = rows < end
    pair = gl.load(order_ptr + rows, mask=row_ok, other=0)
    weight = gl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(gl.float32)
    out = (acc.to(gl.bfloat16).to(gl.float32) * gl.expand_dims(weight, 1)).to(gl.bfloat16)

    store_layout: gl.constexpr = _store_layout(BLOCK_N, num_warps)
    out = gl.convert_layout(out, store_layout)
    rows_s = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
    ok_s = rows_s < end
    pair_s = gl.load(order_ptr + rows_s, mask=ok_s, other=0)
    cols = col_block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    ptrs = y_ptr + gl.expand_dims(pair_s.to(gl.int64) * hidden, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, out, mask=gl.expand_dims(ok_s, 1))


@gluon.jit
def _item(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, q0, v, k, last, first, end, col_block, order_ptr,
          topk_w_ptr, y_ptr, hidden, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, ROWS: gl.constexpr,
          BLOCK_N: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr, A_STATIONARY: gl.constexpr,
          num_warps: gl.constexpr):
    if NUM_CONSUMERS > 1:
        # My turn for the main loop: the other consumer has issued every MMA of the previous item,
        # so waited on all its ring positions (its (k + CONSUMER)-th arrival on turn[CONSUMER];
        # consumer 0's first item waits for nothing).
        m = k + CONSUMER - 1
        mbarrier.wait(turn.index(CONSUMER), m & 1, pred=m >= 0)
    acc = _mainloop(a_bufs, b_bufs, ready, empty, a_ready, a_empty, q0, v, last, ROWS, BLOCK_N, KSTEPS, STAGES,
                    A_STATIONARY, num_warps)
    if NUM_CONSUMERS > 1:
        # Every ring position of this item has been waited on, so the other consumer may start
        # issuing (its waits are on the following positions) while my last MMA drains: as CUTLASS's
        # pingpong arrives on its order barrier before the main loop's tail.
        mbarrier.arrive(turn.index(1 - CONSUMER))
    acc = _retire(acc, empty, a_empty, q0, last, KSTEPS, STAGES, A_STATIONARY)
    _epilogue(acc, first, end, col_block, order_ptr, topk_w_ptr, y_ptr, hidden, ROWS, BLOCK_N, num_warps)


@gluon.jit
def _items(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, q0, v, k, last, first, end, half, col_block,
           order_ptr, topk_w_ptr, y_ptr, hidden, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
           HALF_TAIL: gl.constexpr, A_STATIONARY: gl.constexpr, num_warps: gl.constexpr):
    """One item, as a BLOCK_M / 2-row tile when ``half``."""
    if HALF_TAIL:
        if half:
            _item(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, q0, v, k, last, first, end, col_block,
                  order_ptr, topk_w_ptr, y_ptr, hidden, CONSUMER, NUM_CONSUMERS, BLOCK_M // 2, BLOCK_N, KSTEPS,
                  STAGES, A_STATIONARY, num_warps)
        else:
            _item(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, q0, v, k, last, first, end, col_block,
                  order_ptr, topk_w_ptr, y_ptr, hidden, CONSUMER, NUM_CONSUMERS, BLOCK_M, BLOCK_N, KSTEPS, STAGES,
                  A_STATIONARY, num_warps)
    else:
        _item(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, q0, v, k, last, first, end, col_block, order_ptr,
              topk_w_ptr, y_ptr, hidden, CONSUMER, NUM_CONSUMERS, BLOCK_M, BLOCK_N, KSTEPS, STAGES, A_STATIONARY,
              num_warps)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, map_ptr, map_tiles, order_ptr, topk_w_ptr,
              y_ptr, hidden, CONSUMER: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              HALF_TAIL: gl.constexpr, CHUNK: gl.constexpr, A_STATIONARY: gl.constexpr, num_warps: gl.constexpr):
    """The program's items j with j % NUM_CONSUMERS == CONSUMER: the consumers alternate item by item,
    consumer c's k-th item being the program's j = NUM_CONSUMERS * k + c (ring positions from j * KSTEPS)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    row_tiles = gl.load(map_ptr + 3 * map_tiles)
    col_blocks = hidden // BLOCK_N
    units = row_tiles * (col_blocks // CHUNK)
    if A_STATIONARY:
        # Every consumer takes items of every unit: blocks CONSUMER, CONSUMER + NUM_CONSUMERS, ...
        k = 0
        v = 0
        for unit in range(pid, units, nprog):
            tile, col0 = _unit(unit, row_tiles, col_blocks, CHUNK, GROUP_M)
            first = gl.load(map_ptr + map_tiles + tile)
            end = gl.load(map_ptr + 2 * map_tiles + tile)
            half = _is_half(first, end, HALF_TAIL, BLOCK_M)
            for b in range(CONSUMER, CHUNK, NUM_CONSUMERS):
                _items(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, (v * CHUNK + b) * KSTEPS, v, k,
                       b + NUM_CONSUMERS >= CHUNK, first, end, half, col0 + b, order_ptr, topk_w_ptr, y_ptr, hidden,
                       CONSUMER, NUM_CONSUMERS, BLOCK_M, BLOCK_N, KSTEPS, STAGES, HALF_TAIL, A_STATIONARY, num_warps)
                k += 1
            v += 1
    else:
        # Units of one item, dealt round robin: my k-th is the program's (NUM_CONSUMERS * k + CONSUMER)-th.
        k = 0
        for unit in range(pid + CONSUMER * nprog, units, NUM_CONSUMERS * nprog):
            tile, col0 = _unit(unit, row_tiles, col_blocks, CHUNK, GROUP_M)
            first = gl.load(map_ptr + map_tiles + tile)
            end = gl.load(map_ptr + 2 * map_tiles + tile)
            half = _is_half(first, end, HALF_TAIL, BLOCK_M)
            _items(a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, (NUM_CONSUMERS * k + CONSUMER) * KSTEPS, 0,
                   k, False, first, end, half, col0, order_ptr, topk_w_ptr, y_ptr, hidden, CONSUMER, NUM_CONSUMERS,
                   BLOCK_M, BLOCK_N, KSTEPS, STAGES, HALF_TAIL, A_STATIONARY, num_warps)
            k += 1


# ----------------------------------------------------------------------------------------------
# Kernel


@gluon.jit
def gluon_down_kernel(h_desc, h_half_desc, w_desc, order_ptr, topk_w_ptr, y_ptr, map_ptr, map_tiles, hidden,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, KSTEPS: gl.constexpr,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                      HALF_TAIL: gl.constexpr, CHUNK: gl.constexpr, A_STATIONARY: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(CHUNK == 1 or A_STATIONARY, "streaming: one column block a unit")
    # A-stationary: every consumer takes an item of each unit (each releases the unit's A blocks).
    gl.static_assert(CHUNK % NUM_CONSUMERS == 0 or not A_STATIONARY, "A-stationary: CHUNK % NUM_CONSUMERS")
    A_BUFS: gl.constexpr = KSTEPS if A_STATIONARY else STAGES
    a_bufs = gl.allocate_shared_memory(h_desc.dtype, [A_BUFS] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [KSTEPS, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [KSTEPS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # ready: the producer's expect-tx arrival (+ the TMA bytes); empty: one consumer's release.
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(KSTEPS):
        # a_empty: every consumer's release of the unit's A block.
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=NUM_CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    # (The argument tuples are written in the calls: a tuple assigned to a variable first turns its
    # constexprs into tensors.)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, map_ptr, map_tiles, order_ptr,
                         topk_w_ptr, y_ptr, hidden, 0, 2, BLOCK_M, BLOCK_N, KSTEPS, STAGES, GROUP_M, HALF_TAIL, CHUNK,
                         A_STATIONARY, num_warps)),
            (_consumer, (a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, map_ptr, map_tiles, order_ptr,
                         topk_w_ptr, y_ptr, hidden, 1, 2, BLOCK_M, BLOCK_N, KSTEPS, STAGES, GROUP_M, HALF_TAIL, CHUNK,
                         A_STATIONARY, num_warps)),
            (_producer, (h_desc, h_half_desc, w_desc, a_bufs, b_bufs, ready, empty, a_ready, a_empty, map_ptr,
                         map_tiles, hidden, BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, STAGES, GROUP_M, HALF_TAIL, CHUNK,
                         A_STATIONARY)),
        ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, a_ready, a_empty, turn, map_ptr, map_tiles, order_ptr,
                         topk_w_ptr, y_ptr, hidden, 0, 1, BLOCK_M, BLOCK_N, KSTEPS, STAGES, GROUP_M, HALF_TAIL, CHUNK,
                         A_STATIONARY, num_warps)),
            (_producer, (h_desc, h_half_desc, w_desc, a_bufs, b_bufs, ready, empty, a_ready, a_empty, map_ptr,
                         map_tiles, hidden, BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, STAGES, GROUP_M, HALF_TAIL, CHUNK,
                         A_STATIONARY)),
        ], [1], [PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher

SCHEDULES = {"pingpong": (2, 4), "cooperative": (1, 8), "single": (1, 4)}


def _descs(h, w2, block_m, block_n, block_k):
    inter = h.shape[1]
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_k], gl.bfloat16)
    a_half_layout = gl.NVMMASharedLayout.get_default_for([block_m // 2, block_k], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
    return (TensorDescriptor.from_tensor(h, [block_m, block_k], a_layout),
            TensorDescriptor.from_tensor(h, [block_m // 2, block_k], a_half_layout),
            TensorDescriptor.from_tensor(w2.reshape(-1, inter), [block_n, block_k], b_layout))


def launch(h, w2, order, topk_weights, y, tiles, map_tiles, programs, block_n=128, stages=4,
           schedule="pingpong", half_tail=False, chunk=0, group_m=8, block_m=128, block_k=64, consumer_regs=None,
           producer_regs=None, maxnreg=None, ctas_per_sm=1, warmup=False):
    """One launch over ``tiles`` (``moe.tile_map``'s ``[3 · map_tiles + 1]``) on ``programs`` CTAs
    (``warmup``: compile only). ``chunk``: 0 streams A with B (units of one column block, grouped by
    ``group_m``); > 0 keeps a row tile's h rows in shared memory over ``chunk`` column blocks
    (A-stationary)."""
    _, hidden, inter = w2.shape
    assert h.dtype == w2.dtype == y.dtype == torch.bfloat16 and inter % block_k == 0 and hidden % block_n == 0
    assert chunk == 0 or (hidden // block_n) % chunk == 0
    num_consumers, warps = SCHEDULES[schedule]
    # Registers: the launch gives every thread ``maxnreg``; setmaxnreg then moves them from the
    # producer's warpgroup to the consumers'. 64K registers an SM over the warpgroups of all CTAs.
    groups = num_consumers * warps // 4 + 1
    if producer_regs is None:
        producer_regs = 24
    if maxnreg is None:
        maxnreg = min(255, (65536 // (groups * 128 * ctas_per_sm)) // 8 * 8)
    if consumer_regs is None:
        consumer_regs = min(240, ((maxnreg * groups - producer_regs) // (groups - 1)) // 8 * 8)
    h_desc, h_half_desc, w_desc = _descs(h, w2, block_m, block_n, block_k)
    args = (h_desc, h_half_desc, w_desc, order, topk_weights, y, tiles, map_tiles, hidden)
    options = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, KSTEPS=inter // block_k, STAGES=stages,
        GROUP_M=group_m, NUM_CONSUMERS=num_consumers, HALF_TAIL=half_tail, CHUNK=max(chunk, 1),
        A_STATIONARY=chunk > 0, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=warps,
        maxnreg=maxnreg,
    )
    if warmup:
        return gluon_down_kernel.warmup(*args, grid=(programs,), **options)
    return gluon_down_kernel[(programs,)](*args, **options)


_SMS = {}


def gluon_down(h, w2, order, offsets, topk_weights, y, block_n=128, stages=4, schedule="pingpong", half_tail=False,
               chunk=0, group_m=8, ctas_per_sm=None, programs=None, **kw):
    """``moe.down`` (routed pairs only) through the Gluon kernel: the row tiles from ``moe.tile_map``.
    ``programs``: a smaller grid than one CTA an SM (a test: more units a program)."""
    from freetoken.kernels.triton import moe

    block_m = 128
    num_pairs = order.shape[0]
    tiles, map_tiles = moe.tile_map(offsets, num_pairs, block_m)
    dev = h.device
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    if ctas_per_sm is None:
        ctas_per_sm = 2 if schedule == "single" else 1
    units = map_tiles * (w2.shape[1] // block_n) // max(chunk, 1)
    programs = max(1, min(units, ctas_per_sm * _SMS[dev], programs or units))
    return launch(h, w2, order, topk_weights.reshape(-1), y, tiles, map_tiles, programs, block_n=block_n,
                  stages=stages, schedule=schedule, half_tail=half_tail, chunk=chunk, group_m=group_m,
                  block_m=block_m, ctas_per_sm=ctas_per_sm, **kw)


# ----------------------------------------------------------------------------------------------
# GPU check and benchmark

VARIANTS = [
    # (name, gluon_down keyword arguments), simplest synchronization first (so a hang names the
    # least it can): streaming with one consumer, streaming pingpong (the turn barriers), then the
    # A-stationary kernels (the likeliest winners: the streaming kernels move ~2.6 GB of operands
    # L2 -> SM at T=8192, the A-stationary ones ~1.4 GB).
    ("cooperative n256 s4", dict(schedule="cooperative", block_n=256, stages=4)),
    ("cooperative n256 s3", dict(schedule="cooperative", block_n=256, stages=3)),
    ("cooperative n256 s4 half", dict(schedule="cooperative", block_n=256, stages=4, half_tail=True)),
    ("single x2/SM n128 s3 half", dict(schedule="single", block_n=128, stages=3, half_tail=True)),
    ("pingpong n128 s4", dict(schedule="pingpong", block_n=128, stages=4)),
    ("pingpong n128 s5", dict(schedule="pingpong", block_n=128, stages=5)),
    ("pingpong n128 s4 half", dict(schedule="pingpong", block_n=128, stages=4, half_tail=True)),
    ("pingpong n128 s6 half", dict(schedule="pingpong", block_n=128, stages=6, half_tail=True)),
    ("cooperative n128 s4 a-stat chunk8 half", dict(schedule="cooperative", block_n=128, stages=4, chunk=8,
                                                    half_tail=True)),
    ("cooperative n256 s2 a-stat chunk8 half", dict(schedule="cooperative", block_n=256, stages=2, chunk=8,
                                                    half_tail=True)),
    ("cooperative n256 s2 a-stat chunk4 half", dict(schedule="cooperative", block_n=256, stages=2, chunk=4,
                                                    half_tail=True)),
    ("pingpong n128 s4 a-stat chunk16", dict(schedule="pingpong", block_n=128, stages=4, chunk=16)),
    ("pingpong n128 s4 a-stat chunk8", dict(schedule="pingpong", block_n=128, stages=4, chunk=8)),
    ("pingpong n128 s4 a-stat chunk16 half", dict(schedule="pingpong", block_n=128, stages=4, chunk=16,
                                                  half_tail=True)),
    ("pingpong n128 s4 a-stat chunk8 half", dict(schedule="pingpong", block_n=128, stages=4, chunk=8, half_tail=True)),
    ("pingpong n128 s3 a-stat chunk8 half", dict(schedule="pingpong", block_n=128, stages=3, chunk=8, half_tail=True)),
    ("pingpong n128 s4 a-stat chunk4 half", dict(schedule="pingpong", block_n=128, stages=4, chunk=4, half_tail=True)),
]


def _inputs(tokens, experts, hidden=2048, inter=512, top_k=8):
    """``benchmarks/prefill_sweep.py``'s ``moe_sweep`` inputs (seeded), down GEMM only."""
    from freetoken.kernels.triton import moe

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = torch.bfloat16
    torch.randn(tokens, hidden, dtype=bf16, device=dev, generator=gen)  # x, as the sweep draws it
    torch.randn(experts, 2 * inter, hidden, dtype=bf16, device=dev, generator=gen)  # w13
    w2 = torch.randn(experts, hidden, inter, dtype=bf16, device=dev, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, dtype=bf16, device=dev, generator=gen)
    weights, ids = moe.moe_topk_softmax(logits, top_k, True)
    order, offsets = moe.moe_sort_tokens(ids, experts)
    pairs = tokens * top_k
    h = torch.randn(pairs, inter, dtype=bf16, device=dev, generator=gen)
    return h, w2, order, offsets, weights


def _warm(kw, tokens, experts, hidden, inter, top_k):
    """Compile one variant (in a worker process) for launches on inputs of these sizes: the kernel
    specializes on the integer arguments' divisibility, so the same shapes as the real run."""
    from freetoken.kernels.triton import moe

    t0 = time.time()
    try:
        dev = torch.device("cuda")
        pairs, bf16 = tokens * top_k, torch.bfloat16
        map_tiles = moe._row_tiles(pairs, experts, 128)
        h = torch.empty(pairs, inter, dtype=bf16, device=dev)
        w2 = torch.empty(experts, hidden, inter, dtype=bf16, device=dev)
        y = torch.empty(pairs, hidden, dtype=bf16, device=dev)
        order = torch.empty(pairs, dtype=torch.int32, device=dev)
        weights = torch.empty(pairs, dtype=bf16, device=dev)
        tiles = torch.empty(3 * map_tiles + 1, dtype=torch.int32, device=dev)
        kw = dict(kw)
        kw.pop("programs", None)
        kw.setdefault("ctas_per_sm", 2 if kw.get("schedule") == "single" else 1)  # as gluon_down: same maxnreg
        launch(h, w2, order, weights, y, tiles, map_tiles, 132, warmup=True, **kw)
        return f"compiled in {time.time() - t0:.1f} s"
    except Exception as exc:  # reported again by the real launch
        return f"compile failed: {type(exc).__name__}: {str(exc)[-300:]}"


def _precompile(variants, jobs, *sizes):
    """Every variant compiled in ``jobs`` worker processes first (Triton's on-disk cache then serves
    the real launches): ~6 s of single-threaded compilation each."""
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {name: pool.submit(_warm, kw, *sizes) for name, kw in variants}
        for name, future in futures.items():
            try:
                print(f"   precompile {name}: {future.result()}", flush=True)
            except Exception as exc:
                print(f"   precompile {name}: worker failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"precompiled {len(variants)} variants in {time.time() - t0:.1f} s", flush=True)


def _diff(out, ref):
    """(max abs diff, max abs diff / max |ref|, elements that differ, NaNs in out)."""
    d = (out.float() - ref.float()).abs()
    rel = d.max().item() / max(ref.float().abs().max().item(), 1e-30)
    mism = (out != ref).sum().item()
    nan = torch.isnan(out.float()).sum().item()
    return d.max().item(), rel, mism, nan


def _hung(label, seconds):
    print(f"!! {label} did not finish in {seconds:.0f} s: hung (exiting; rerun the others with --only)", flush=True)
    os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true",
                        help="T=256, E=8: correctness only (each variant also on a 3-program grid: many units a program)")
    parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=8, help="compile the variants in this many processes first (0: no)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds a variant may take (first launch + timing) before the run exits as hung")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from graph_timing import graph_us

    from freetoken.kernels.triton import moe
    from freetoken.kernels.triton.moe_configs import config_source, moe_gemm_config

    tokens, experts = (256, 8) if args.small else (8192, 256)
    tokens = args.tokens or tokens
    hidden, inter, top_k = 2048, 512, 8
    variants = [(n, kw) for n, kw in VARIANTS if not args.only or any(s in n for s in args.only)]
    print(f"device {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}, "
          f"T={tokens} E={experts}", flush=True)
    if args.jobs:
        _precompile(variants, args.jobs, tokens, experts, hidden, inter, top_k)
    h, w2, order, offsets, weights = _inputs(tokens, experts, hidden, inter, top_k)
    pairs = tokens * top_k
    flops = 2 * pairs * inter * hidden
    config = moe_gemm_config("down", torch.bfloat16, pairs, experts, hidden, inter)
    ref = torch.full((pairs, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe.down(h, w2, order, offsets, weights, ref, config)
    torch.cuda.synchronize()
    # The Triton kernel itself against torch (float32 products, rounded as _down_store rounds).
    check = torch.empty(pairs, hidden, dtype=torch.float32, device="cuda")
    bounds = offsets.tolist()
    for e in range(experts):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            pair = order[lo:hi].long()
            acc = (h[lo:hi].float() @ w2[e].float().T).to(torch.bfloat16).float()
            check[pair] = acc * weights.reshape(-1)[pair, None].float()
    abs_d, rel_d, mism, nan = _diff(ref, check.to(torch.bfloat16))
    print(f"triton moe.down vs torch: max abs {abs_d:.3e} rel {rel_d:.3e} differing {mism} NaN {nan}", flush=True)
    del check
    reps = 10

    def repeated(fn):
        def run():
            for _ in range(reps):
                fn()
        return run

    rows = []
    if not args.small:
        us = graph_us(repeated(lambda: moe.down(h, w2, order, offsets, weights, ref, config)), reps)
        rows.append(("triton " + config_source(config), us))
        print(f"triton {config_source(config)}: {us:.1f} us {flops / us / 1e6:.1f} TFLOP/s", flush=True)
    grids = [None, 3] if args.small else [None]
    for name, kw in variants:
        for programs in grids:
            label = name + ("" if programs is None else f" ({programs} programs)")
            print(f"-- launching {label} ...", flush=True)
            # A kernel that never finishes blocks this process in a CUDA call: exit naming it instead.
            watchdog = threading.Timer(args.timeout, _hung, (label, args.timeout))
            watchdog.start()
            try:
                y = torch.full((pairs, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
                t0 = time.time()
                gluon_down(h, w2, order, offsets, weights, y, programs=programs, **kw)
                torch.cuda.synchronize()
                abs_d, rel_d, mism, nan = _diff(y, ref)
                print(f"   first launch {time.time() - t0:.1f} s; vs triton: max abs {abs_d:.3e} rel {rel_d:.3e} "
                      f"differing elements {mism} NaN {nan}", flush=True)
                if args.small:
                    continue
                us = graph_us(repeated(lambda: gluon_down(h, w2, order, offsets, weights, y, **kw)), reps)
                rows.append((label, us))
                print(f"   {label}: {us:.1f} us {flops / us / 1e6:.1f} TFLOP/s", flush=True)
            except Exception as exc:
                print(f"   {label} failed: {type(exc).__name__}: {str(exc)[-400:]}", flush=True)
                traceback.print_exc(limit=2)
            finally:
                watchdog.cancel()
    if rows:
        print("\n| variant | us | TFLOP/s |\n|---|---:|---:|")
        for name, us in rows:
            print(f"| {name} | {us:.1f} | {flops / us / 1e6:.1f} |")


if __name__ == "__main__":
    main()
