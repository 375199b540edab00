"""Triton GEMV for a few activation rows (decode): ``y = x @ W.T``, ``W [N, K]`` row-major.

At one to eight rows a projection is a stream of its weight bytes, and what decides its time is how
many bytes are in flight and how fast the launch ramps up and drains. Each program owns ``block_n``
whole weight rows and streams all of K (2048 or 4096 at the Qwen3.6-35B-A3B shape) in ``block_k``
steps; the weights are read once for all rows. No split-K: the rows alone give the programs. Two
kernels, the launch shape (``GemvConfig``) picks one:

- ``_gemv_kernel`` (FMA): 16-byte loads a thread, a warp's lanes across a 256-column chunk of a row,
  the warps on the rows, the step's chunks in each thread's registers; each activation row (a few
  KB, from L1/L2) multiplied against the loaded step in float32, so a row's sum is in-thread adds
  plus one warp reduction. Every dtype; float32 runs are exact float32 sums.
- ``_gemv_dot_kernel`` (``GemvConfig.dot``, 2-byte weights): ``W tile @ x.T`` on the tensor cores,
  the rows padded to 16, the loads pipelined through shared memory (cp.async): fewer instructions a
  weight where eight rows make the FMA kernel's work count.

Under programmatic dependent launch (``GemvConfig.pdl``, sm_90 on) a program first lets the next
launch start (its programs take SM slots as these finish) and waits for the previous launch
(``griddepcontrol.wait``) only before reading ``x``, the previous launch's output: the FMA kernel
loads its first weight step before that (the model never writes its weights); the tensor-core one
waits before its loop, whose pipelined prologue issues ``x``'s first loads. Consecutive projections
then overlap one's drain with the next's ramp-up, inside CUDA graphs too.

``benchmarks/gemv_sweep.py`` times the shapes; ``kernels/gemv_configs.py`` holds its table. Float32
accumulation in a fixed order per program; the output is rounded once to ``x``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.gemv import GEMV_DTYPES
from freetoken.kernels.gemv_configs import GEMV_MAX_ROWS, GemvConfig, gemv_config
from freetoken.kernels.triton._common import INTERPRETED, cast, dot, new_empty, pow2
from freetoken.kernels.triton.moe_decode import _pdl_available


@triton.jit
def _gemv_kernel(
    x_ptr, x_st, w_ptr, w_st, out_ptr, M, N, K,
    ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, REPS: tl.constexpr, CHUNK: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next launch may start: its programs take the slots these leave
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # A step is REPS chunks of CHUNK columns, the tile [BLOCK_N, REPS, CHUNK]: a warp's lanes span a
    # chunk (16 bytes each), the warps the rows, and the chunks repeat in each thread's registers, so
    # a row's sum is in-thread adds over the chunks and one warp reduction (no shared memory).
    # (Triton orders the tile's dimensions by contiguity, ties by position: rows before chunks.)
    # Rows past N read row N - 1 again (from L1) instead of masking every weight load. The weights
    # are read once a step: evict_first keeps them from pushing activations and caches out of L2.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * w_st
    cols = (tl.arange(0, REPS) * CHUNK)[:, None] + tl.arange(0, CHUNK)[None, :]  # [REPS, CHUNK]
    m0 = tl.program_id(1) * ROWS
    m = tl.arange(0, ROWS_P2)
    acc = tl.zeros([BLOCK_N, ROWS_P2], tl.float32)
    for k0 in range(0, K, REPS * CHUNK):
        k = k0 + cols
        if EVEN_K:
            w = tl.load(w_rows + k[None, :, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + k[None, :, :], mask=(k < K)[None, :, :], other=0.0, eviction_policy="evict_first")
        if PDL:  # x is the previous launch's output; returns at once after the first step
            tl.extra.cuda.gdc_wait()
        w = w.to(tl.float32)
        for i in tl.static_range(ROWS):
            # A last chunk's rows past M read row M - 1 again; their sums are not stored.
            row = tl.minimum(m0 + i, M - 1).to(tl.int64)
            # Loaded through a tile-shaped pointer (zero row offsets) so that it takes the weights'
            # layout: a [REPS, CHUNK] load would be moved through shared memory to meet it.
            x_cols = x_ptr + row * x_st + k[None, :, :] + 0 * n[:, None, None]
            if EVEN_K:
                xv = tl.load(x_cols)
            else:
                xv = tl.load(x_cols, mask=(k < K)[None, :, :], other=0.0)
            part = tl.sum(tl.sum(w * xv.to(tl.float32), 1), 1)  # over the chunks in-thread, then the lanes
            acc = tl.where((m == i)[None, :], acc + part[:, None], acc)
    out_rows = m0 + m
    tl.store(out_ptr + out_rows.to(tl.int64)[None, :] * N + n[:, None], cast(acc, out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (out_rows < M)[None, :] & (m < ROWS)[None, :])


@triton.jit
def _gemv_dot_kernel(
    x_ptr, x_st, w_ptr, w_st, out_ptr, M, N, K, rows_per_program,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    """The tensor-core variant: ``acc [BLOCK_N, 16] += W tile @ x.T`` (the weights the MMA's wide
    operand, the rows padded to 16: one compile for every row count), the loop's loads pipelined
    through shared memory."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # Before the loop: the pipeliner issues the first steps' loads, x's among them, ahead of it.
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * w_st
    j = tl.arange(0, 16)
    m = tl.program_id(1) * rows_per_program + j
    m_ok = (j < rows_per_program) & (m < M)
    x_rows = x_ptr + m.to(tl.int64)[None, :] * x_st
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            xt = tl.load(x_rows + k[:, None], mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_rows + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc += dot(w, xt, "ieee")
    tl.store(out_ptr + m.to(tl.int64)[None, :] * N + n[:, None], cast(acc, out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree (weight [N, K], x [..., K])"
        )
    if x.dtype != weight.dtype or x.dtype not in GEMV_DTYPES:
        raise ValueError(f"gemv: x {x.dtype} and weight {weight.dtype} must be one of {GEMV_DTYPES}, the same")


def gemv_tiled(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """``gemv`` launched in the given shape (``benchmarks/gemv_sweep.py``, the tests)."""
    _check(x, weight)
    n_out, k_in = weight.shape
    rows = x.reshape(-1, k_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    num_rows = rows.shape[0]
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    if num_rows and n_out:
        per_program = min(num_rows, GEMV_MAX_ROWS)
        grid = (triton.cdiv(n_out, config.block_n), triton.cdiv(num_rows, per_program))
        pdl = config.pdl and _pdl_available()
        if config.dot and weight.element_size() == 2:
            block_k = min(config.block_k, pow2(k_in, 16))
            _gemv_dot_kernel[grid](
                rows, rows.stride(0), weight, weight.stride(0), out, num_rows, n_out, k_in, per_program,
                BLOCK_N=config.block_n, BLOCK_K=block_k, EVEN_K=k_in % block_k == 0, PDL=pdl,
                num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
            )
        else:
            # A chunk: 32 lanes x 16 bytes (256 2-byte or 128 float32 columns), at most K; config.block_k
            # counts 2-byte columns, so float32 steps take half as many columns, the same bytes.
            chunk = min(32 * 16 // weight.element_size(), pow2(k_in))
            reps = max(1, config.block_k * 2 // weight.element_size() // chunk)
            _gemv_kernel[grid](
                rows, rows.stride(0), weight, weight.stride(0), out, num_rows, n_out, k_in,
                ROWS=per_program, ROWS_P2=pow2(per_program), BLOCK_N=config.block_n, REPS=reps, CHUNK=chunk,
                EVEN_K=k_in % (reps * chunk) == 0, PDL=pdl,
                num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
            )
    return out.reshape(*x.shape[:-1], n_out)


# Under the interpreter, whose cost is per program and per operation: few, wide programs.
_INTERPRETER_CONFIG = GemvConfig(block_n=64, block_k=256, num_warps=4, pdl=False)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check(x, weight)
    n_out, k_in = weight.shape
    num_rows = x.numel() // k_in if k_in else 0
    config = _INTERPRETER_CONFIG if INTERPRETED else gemv_config(num_rows, n_out, k_in)
    return gemv_tiled(x, weight, config)
