"""Triton ``add_rms_norm_gemv``: the few-row GEMV (``kernels/triton/gemv.py``'s FMA kernel) with the
residual add + RMSNorm of its activation rows in its prologue.

One program holds every row (at most ``gemv_configs.NORMED_MAX_ROWS``) and ``block_n`` weight rows.
It loads its first weight step, waits for the previous launch (programmatic dependent launch), then
computes each row's ``1 / rms`` over the whole row (a ``[1, K]`` tile, as ``_rms_norm_kernel``
reduces it), and per step normalizes the step's columns once into a ``[REPS, CHUNK]`` tile that the
weight tile's rows share (held by the threads that hold those columns: the norm is not recomputed
per weight row a thread holds). Program 0 also writes ``x + residual`` and, when asked, the
normalized rows, to fresh buffers: no program of the launch reads a buffer another one writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.gemv import GEMV_DTYPES
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS, GemvConfig, normed_gemv_config
from freetoken.kernels.triton._common import INTERPRETED, cast, device_function, new_empty, pow2, round_as
from freetoken.kernels.triton.moe_decode import _pdl_available


@device_function
def _summed(x_row, r_row, k, k_ok, HAS_RESIDUAL: tl.constexpr):
    """float32 ``x + residual`` at columns ``k`` (rounded to the activations' dtype, as the reference)."""
    x = tl.load(x_row + k, mask=k_ok, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        xf = round_as(xf + tl.load(r_row + k, mask=k_ok, other=0.0).to(tl.float32), x.dtype)
    return xf


@device_function
def _normalized(xf, inv_rms, nw, dtype: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """``norm(s)`` rounded to ``dtype`` (kept in float32), as ``_rms_norm_kernel`` computes it."""
    normed = xf * inv_rms
    if ZERO_CENTERED:
        y = normed * (1.0 + nw)
    else:
        y = nw * round_as(normed, dtype)
    return round_as(y, dtype)


@device_function
def _inv_rms(x_row, r_row, K, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    """``1 / rms(s)`` of one row, reduced over a ``[1, BLOCK_D]`` tile as the norm kernel reduces it."""
    cols = tl.arange(0, BLOCK_D)[None, :]
    xf = _summed(x_row, r_row, cols, cols < K, HAS_RESIDUAL)
    return tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)  # [1]


@device_function
def _step(acc, w, k, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K,
          HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr):
    """``acc [BLOCK_N, ROWS_P2] +=`` the weight step ``w [BLOCK_N, REPS, CHUNK]`` against each row's
    normalized columns ``k [REPS, CHUNK]`` (the order of ``_gemv_kernel``'s sums)."""
    dtype = x_ptr.dtype.element_ty
    k_ok = k < K
    wf = w.to(tl.float32)
    nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS):
        inv_i = tl.sum(tl.where(m == i, inv, 0.0), 0)
        xf = _summed(x_ptr + i * x_st, r_ptr + i * r_st, k, k_ok, HAS_RESIDUAL)
        xn = _normalized(xf, inv_i, nw, dtype, ZERO_CENTERED)
        part = tl.sum(tl.sum(wf * xn[None, :, :], 1), 1)
        acc = tl.where((m == i)[None, :], acc + part[:, None], acc)
    return acc


@triton.jit
def _normed_gemv_kernel(
    x_ptr, x_st, r_ptr, r_st, nw_ptr, w_ptr, w_st, out_ptr, normed_ptr, sum_ptr, N, K, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, WRITE_NORMED: tl.constexpr,
    ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, REPS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next launch may start: its programs take the slots these leave
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N - 1 again (see _gemv_kernel); the weights are read once: evict_first.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * w_st
    cols = (tl.arange(0, REPS) * CHUNK)[:, None] + tl.arange(0, CHUNK)[None, :]  # [REPS, CHUNK]
    STEP: tl.constexpr = REPS * CHUNK
    # The first weight step is loaded before the wait: the model never writes its weights.
    w = tl.load(w_rows + cols[None, :, :], mask=(cols < K)[None, :, :], other=0.0, eviction_policy="evict_first")
    if PDL:  # x and the residual are earlier launches' outputs
        tl.extra.cuda.gdc_wait()
    m = tl.arange(0, ROWS_P2)
    inv = tl.zeros([ROWS_P2], tl.float32)
    for i in tl.static_range(ROWS):
        inv_i = tl.sum(_inv_rms(x_ptr + i * x_st, r_ptr + i * r_st, K, eps, HAS_RESIDUAL, BLOCK_D), 0)
        inv = tl.where(m == i, inv_i, inv)
    acc = tl.zeros([BLOCK_N, ROWS_P2], tl.float32)
    acc = _step(acc, w, cols, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K, HAS_RESIDUAL, ZERO_CENTERED, ROWS)
    for k0 in range(STEP, K, STEP):
        k = k0 + cols
        w = tl.load(w_rows + k[None, :, :], mask=(k < K)[None, :, :], other=0.0, eviction_policy="evict_first")
        acc = _step(acc, w, k, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K, HAS_RESIDUAL, ZERO_CENTERED, ROWS)
    dtype = x_ptr.dtype.element_ty
    tl.store(out_ptr + m[None, :] * N + n[:, None], cast(acc, dtype), mask=(n < N)[:, None] & (m < ROWS)[None, :])
    if tl.program_id(0) == 0:
        if HAS_RESIDUAL or WRITE_NORMED:
            d = tl.arange(0, BLOCK_D)[None, :]
            d_ok = d < K
            nw = tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            for i in tl.static_range(ROWS):
                xf = _summed(x_ptr + i * x_st, r_ptr + i * r_st, d, d_ok, HAS_RESIDUAL)
                if HAS_RESIDUAL:
                    tl.store(sum_ptr + i * K + d, cast(xf, dtype), mask=d_ok)
                if WRITE_NORMED:
                    inv_i = tl.sum(tl.where(m == i, inv, 0.0), 0)
                    tl.store(normed_ptr + i * K + d, cast(_normalized(xf, inv_i, nw, dtype, ZERO_CENTERED), dtype),
                             mask=d_ok)


def _rows(t: torch.Tensor, k_in: int) -> torch.Tensor:
    rows = t.reshape(-1, k_in)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check(x, residual, norm_weight, zero_centered, weight) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"add_rms_norm_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree")
    if x.dtype != weight.dtype or x.dtype not in GEMV_DTYPES:
        raise ValueError(f"add_rms_norm_gemv: x {x.dtype} and weight {weight.dtype} must be one of {GEMV_DTYPES}, the same")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_gemv: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"add_rms_norm_gemv: norm_weight has shape {tuple(norm_weight.shape)}, expected ({x.shape[-1]},)")
    if not zero_centered and norm_weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm_gemv: a plain norm's weight must be x's dtype {x.dtype}, got {norm_weight.dtype}")


def add_rms_norm_gemv_tiled(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, return_normed: bool, config: GemvConfig,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm_gemv`` launched in the given shape (``benchmarks/normed_gemv_sweep.py``, the tests)."""
    _check(x, residual, norm_weight, zero_centered, weight)
    n_out, k_in = weight.shape
    rows = _rows(x, k_in)
    num_rows = rows.shape[0]
    if num_rows > NORMED_MAX_ROWS:
        raise ValueError(f"add_rms_norm_gemv: {num_rows} rows, at most {NORMED_MAX_ROWS} (one program holds them)")
    res = _rows(residual, k_in) if residual is not None else rows
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    normed = new_empty(x.shape, x.dtype, x.device) if return_normed else None
    summed = new_empty(x.shape, x.dtype, x.device) if residual is not None else x
    if num_rows and n_out:
        pdl = config.pdl and _pdl_available()
        chunk = min(32 * 16 // weight.element_size(), pow2(k_in))
        reps = max(1, config.block_k * 2 // weight.element_size() // chunk)  # as gemv_tiled: the same sums
        _normed_gemv_kernel[(triton.cdiv(n_out, config.block_n),)](
            rows, rows.stride(0), res, res.stride(0), norm_weight.contiguous(), weight, weight.stride(0), out,
            normed if normed is not None else out, summed if residual is not None else out, n_out, k_in, eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, WRITE_NORMED=return_normed,
            ROWS=num_rows, ROWS_P2=pow2(num_rows), BLOCK_N=config.block_n, REPS=reps, CHUNK=chunk,
            BLOCK_D=pow2(k_in), PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        )
    return out.reshape(*x.shape[:-1], n_out), normed, summed


# Under the interpreter, whose cost is per program and per operation: few, wide programs.
_INTERPRETER_CONFIG = GemvConfig(block_n=64, block_k=256, num_warps=4, pdl=False)


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, return_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    n_out, k_in = weight.shape
    num_rows = x.numel() // k_in if k_in else 0
    config = _INTERPRETER_CONFIG if INTERPRETED else normed_gemv_config(num_rows, n_out, k_in)
    return add_rms_norm_gemv_tiled(x, residual, norm_weight, eps, zero_centered, weight, return_normed, config)
