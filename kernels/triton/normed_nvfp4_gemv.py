"""Triton ``add_rms_norm_nvfp4_gemv``: the NVFP4 GEMV (``nvfp4_rows._gemv_kernel``) with the residual
add + RMSNorm of its activation rows in its prologue (``kernels/normed_nvfp4_gemv.py``).

One program holds every row (at most ``NORMED_NVFP4_MAX_ROWS``) and ``BLOCK_N`` packed weight rows.
It loads its first weight step, waits for the previous launch (programmatic dependent launch,
``PDL``), computes each row's ``1 / rms`` over the whole row as ``normed_gemv`` does (the norm
kernel's reduction), then per step normalizes the step's columns of every row once and reduces
them against the decoded codes (``nvfp4_rows._row_dots``, the GEMV's sums in the GEMV's order).
Program 0 also writes ``x + residual`` and, when asked, the normalized rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.normed_nvfp4_gemv import NORMED_NVFP4_MAX_ROWS
from freetoken.kernels.triton._common import cast, device_function, new_empty, pow2
from freetoken.kernels.triton.moe_decode import _pdl_available
from freetoken.kernels.triton.normed_gemv import _inv_rms, _normalized, _summed
from freetoken.kernels.triton.nvfp4 import GROUP
from freetoken.kernels.triton.nvfp4_rows import _gemv_tiles, _row_dots

# Programmatic dependent launch where the GPU has it (the sweep's A/B: tune_nvfp4_decode.py --dense).
PDL = True


@device_function
def _step(acc, w, s, k0, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K, HAS_RESIDUAL: tl.constexpr,
          ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N] +=`` the packed step ``w`` / ``s`` against every row's normalized
    columns ``k0 ..`` (held 2-D and expanded, as ``_row_dots`` wants its activations)."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    xf = _summed(x_ptr + m[:, None] * x_st, r_ptr + m[:, None] * r_st, k[None, :], (m < ROWS)[:, None] & k_ok[None, :],
                 HAS_RESIDUAL)
    nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    xn = _normalized(xf, inv[:, None], nw, x_ptr.dtype.element_ty, ZERO_CENTERED)
    return acc + _row_dots(w, s, xn[:, None, :], BLOCK_N, BLOCK_K)


@triton.jit
def _normed_nvfp4_gemv_kernel(
    x_ptr, x_st, r_ptr, r_st, nw_ptr, w_ptr, s_ptr, rs_ptr, out_ptr, normed_ptr, sum_ptr, N, K, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, WRITE_NORMED: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # the next launch may start: its programs take the slots these leave
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[None, :, None]
    rows_ok = n_ok[None, :, None]
    half = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // 16)
    # The first weight step is loaded before the wait: the model never writes its weights.
    w = tl.load(w_ptr + rows * (K // 2) + half[None, None, :], mask=rows_ok & (half < K // 2)[None, None, :], other=0)
    s = tl.load(s_ptr + rows * (K // 16) + group[None, None, :], mask=rows_ok & (group < K // 16)[None, None, :], other=0)
    if PDL:  # x and the residual are earlier launches' outputs
        tl.extra.cuda.gdc_wait()
    m = tl.arange(0, BLOCK_M)
    m_ok = m < ROWS
    inv = tl.zeros([BLOCK_M], tl.float32)
    for i in tl.static_range(ROWS):
        inv_i = tl.sum(_inv_rms(x_ptr + i * x_st, r_ptr + i * r_st, K, eps, HAS_RESIDUAL, BLOCK_D), 0)
        inv = tl.where(m == i, inv_i, inv)
    dtype = x_ptr.dtype.element_ty
    acc = _step(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), w, s, 0, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K,
                HAS_RESIDUAL, ZERO_CENTERED, ROWS, BLOCK_N, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptr + rows * (K // 2) + (k0 // 2 + half)[None, None, :],
                    mask=rows_ok & (k0 // 2 + half < K // 2)[None, None, :], other=0)
        s = tl.load(s_ptr + rows * (K // 16) + (k0 // 16 + group)[None, None, :],
                    mask=rows_ok & (k0 // 16 + group < K // 16)[None, None, :], other=0)
        acc = _step(acc, w, s, k0, x_ptr, x_st, r_ptr, r_st, nw_ptr, inv, m, K, HAS_RESIDUAL, ZERO_CENTERED, ROWS,
                    BLOCK_N, BLOCK_K)
    out = acc * tl.load(rs_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], cast(out, dtype), mask=m_ok[:, None] & n_ok[None, :])
    if tl.program_id(0) == 0:
        if HAS_RESIDUAL or WRITE_NORMED:
            d = tl.arange(0, BLOCK_D)[None, :]
            d_ok = d < K
            nwd = tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            for i in tl.static_range(ROWS):
                xd = _summed(x_ptr + i * x_st, r_ptr + i * r_st, d, d_ok, HAS_RESIDUAL)
                if HAS_RESIDUAL:
                    tl.store(sum_ptr + i * K + d, cast(xd, dtype), mask=d_ok)
                if WRITE_NORMED:
                    inv_i = tl.sum(tl.where(m == i, inv, 0.0), 0)
                    tl.store(normed_ptr + i * K + d, cast(_normalized(xd, inv_i, nwd, dtype, ZERO_CENTERED), dtype),
                             mask=d_ok)


def _rows(t: torch.Tensor, k_in: int) -> torch.Tensor:
    rows = t.reshape(-1, k_in)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def add_rms_norm_nvfp4_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_scales: torch.Tensor,
    return_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    n_out, k_in = packed.shape[0], x.shape[-1]
    if packed.dim() != 2 or k_in % GROUP or packed.shape[1] * 2 != k_in or scales.shape != (n_out, k_in // GROUP) \
            or row_scales.shape != (n_out,):
        raise ValueError(f"add_rms_norm_nvfp4_gemv: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scales "
                         f"{tuple(scales.shape)}, row_scales {tuple(row_scales.shape)} are not an NVFP4 weight for x")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_nvfp4_gemv: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if norm_weight.shape != (k_in,):
        raise ValueError(f"add_rms_norm_nvfp4_gemv: norm_weight has shape {tuple(norm_weight.shape)}, expected ({k_in},)")
    if not zero_centered and norm_weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm_nvfp4_gemv: a plain norm's weight must be x's dtype {x.dtype}, got {norm_weight.dtype}")
    rows = _rows(x, k_in)
    num_rows = rows.shape[0]
    if num_rows > NORMED_NVFP4_MAX_ROWS:
        raise ValueError(f"add_rms_norm_nvfp4_gemv: {num_rows} rows, at most {NORMED_NVFP4_MAX_ROWS} (one program holds them)")
    res = _rows(residual, k_in) if residual is not None else rows
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    normed = new_empty(x.shape, x.dtype, x.device) if return_normed else None
    summed = new_empty(x.shape, x.dtype, x.device) if residual is not None else x
    if num_rows and n_out:
        block_n, block_k, warps = _gemv_tiles(n_out)
        pdl = PDL and _pdl_available()
        _normed_nvfp4_gemv_kernel[(triton.cdiv(n_out, block_n),)](
            rows, rows.stride(0), res, res.stride(0), norm_weight.contiguous(), packed.contiguous(),
            scales.contiguous().view(torch.uint8), row_scales.contiguous(), out,
            normed if normed is not None else out, summed if residual is not None else out, n_out, k_in, eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, WRITE_NORMED=return_normed,
            ROWS=num_rows, BLOCK_M=pow2(num_rows), BLOCK_N=block_n, BLOCK_K=min(pow2(k_in), block_k),
            BLOCK_D=pow2(k_in), PDL=pdl, num_warps=warps, launch_pdl=pdl,
        )
    return out.reshape(*x.shape[:-1], n_out), normed, summed
