"""Triton ``add_rms_norm_gemv``: the few-row GEMV (``kernels/triton/gemv.py``'s FMA kernel) with the
residual add + RMSNorm of its activation rows in its prologue.

One program holds every row (at most ``gemv_configs.NORMED_MAX_ROWS``) and ``block_n`` weight rows.
It loads its first weight step, waits for the previous launch (programmatic dependent launch), then
computes each row's ``1 / rms`` over the whole row (a ``[1, K]`` tile, as ``_rms_norm_kernel``
reduces it), and per step normalizes the step's columns once into a ``[REPS, CHUNK]`` tile that the
weight tile's rows share (held by the threads that hold those columns: the norm is not recomputed
per weight row a thread holds). Program 0 also writes ``x + residual`` and, when asked, the
normalized rows, to fresh buffers: no program of the launch reads a buffer another one writes.

``add_rms_norm_gemv_conv`` (the Gated DeltaNet's ``in_proj`` at decode): the programs holding conv
channels (the first ``C`` output rows: q|k|v) also run ``causal_conv1d_decode``'s step on them, from
the projection as stored, in each row's state slot; a (slot, channel) belongs to one program.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from freetoken.kernels.gemv import GEMV_DTYPES
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS, GemvConfig, normed_gemv_config
from freetoken.kernels.triton._common import (
    INTERPRETED,
    cast,
    device_function,
    new_empty,
    pow2,
    round_as,
)
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


@device_function
def _conv_step(acc, m, n, cw_ptr, cs_ptr, cs_ss, cs_sc, cs_sk, slot_ptr, conv_ptr, conv_channels, dtype: tl.constexpr,
               ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """``causal_conv1d_decode`` of output channels ``n`` (those below ``conv_channels``) from the
    projection ``acc [BLOCK_N, ROWS_P2]`` rounded as stored: each row's window (its slot's state, then
    the new value) times the conv weights, SiLU, into ``conv``; the state shifted by one. The
    arithmetic and roundings of ``_conv_decode_kernel``; each (slot, channel) is this program's alone."""
    c_ok = n < conv_channels
    j = tl.arange(0, BLOCK_W)[None, :]
    w = tl.load(cw_ptr + n[:, None] * WIDTH + j, mask=(j < WIDTH) & c_ok[:, None], other=0.0)
    wdtype = cw_ptr.dtype.element_ty
    in_state = (j < WIDTH - 1) & c_ok[:, None]
    for i in tl.static_range(ROWS):
        x = round_as(tl.sum(tl.where((m == i)[None, :], acc, 0.0), 1), dtype)[:, None]
        base = cs_ptr + tl.load(slot_ptr + i).to(tl.int64) * cs_ss + n.to(tl.int64)[:, None] * cs_sc
        window = tl.load(base + j * cs_sk, mask=in_state, other=0.0).to(tl.float32)
        window = tl.where(j == WIDTH - 1, x, window)
        conv = round_as(tl.sum(round_as(window * w.to(tl.float32), wdtype), 1), wdtype)
        tl.store(conv_ptr + i * conv_channels + n, cast(conv * tl.sigmoid(conv), dtype), mask=c_ok)
        # Shift: state[j] = window[j + 1] (loaded before any thread stores).
        shifted = tl.load(base + (j + 1) * cs_sk, mask=((j + 1) < WIDTH - 1) & c_ok[:, None], other=0.0)
        shifted = tl.where(j == WIDTH - 2, x, shifted.to(tl.float32))
        tl.debug_barrier()
        tl.store(base + j * cs_sk, cast(shifted, cs_ptr.dtype.element_ty), mask=in_state)


@triton.jit
def _normed_gemv_kernel(
    x_ptr, x_st, r_ptr, r_st, nw_ptr, w_ptr, w_st, out_ptr, normed_ptr, sum_ptr, N, K, eps,
    cw_ptr, cs_ptr, cs_ss, cs_sc, cs_sk, slot_ptr, conv_ptr, conv_channels,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, WRITE_NORMED: tl.constexpr,
    ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr, REPS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    CONV: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
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
    out = cast(acc, dtype).to(out_ptr.dtype.element_ty)  # rounded as the activations, stored as asked
    tl.store(out_ptr + m[None, :] * N + n[:, None], out, mask=(n < N)[:, None] & (m < ROWS)[None, :])
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
    if CONV:  # the conv1d decode step of this program's conv channels, each row in its state slot
        if tl.program_id(0) * BLOCK_N < conv_channels:
            _conv_step(acc, m, n, cw_ptr, cs_ptr, cs_ss, cs_sc, cs_sk, slot_ptr, conv_ptr, conv_channels, dtype,
                       ROWS, WIDTH, BLOCK_W)


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


class _Conv(NamedTuple):
    """The conv1d decode step the fused GDN input launch adds over the first ``weight.shape[0]``
    output columns (``kernels.causal_conv1d_decode``'s operands)."""

    weight: torch.Tensor  # [C, W]
    state: torch.Tensor  # [slots, C, W - 1]
    slots: torch.Tensor  # [rows] int


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, return_normed: bool, config: GemvConfig,
    out_dtype: torch.dtype | None = None, conv: _Conv | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The fused launch: ``(out, normed, summed, conv_out)``; ``conv_out``, with ``conv``, the conv
    output ``[rows, C]`` (else ``None``)."""
    _check(x, residual, norm_weight, zero_centered, weight)
    n_out, k_in = weight.shape
    rows = _rows(x, k_in)
    num_rows = rows.shape[0]
    if num_rows > NORMED_MAX_ROWS:
        raise ValueError(f"add_rms_norm_gemv: {num_rows} rows, at most {NORMED_MAX_ROWS} (one program holds them)")
    res = _rows(residual, k_in) if residual is not None else rows
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out_dtype is not None and out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"add_rms_norm_gemv: out_dtype must be x's {x.dtype} or float32, got {out_dtype}")
    out = new_empty((num_rows, n_out), out_dtype or x.dtype, x.device)
    normed = new_empty(x.shape, x.dtype, x.device) if return_normed else None
    summed = new_empty(x.shape, x.dtype, x.device) if residual is not None else x
    conv_out = None
    if conv is not None:
        conv_out = new_empty((num_rows, conv.weight.shape[0]), x.dtype, x.device)
    if num_rows and n_out:
        pdl = config.pdl and _pdl_available()
        chunk = min(32 * 16 // weight.element_size(), pow2(k_in))
        reps = max(1, config.block_k * 2 // weight.element_size() // chunk)  # as gemv_tiled: the same sums
        _normed_gemv_kernel[(triton.cdiv(n_out, config.block_n),)](
            rows, rows.stride(0), res, res.stride(0), norm_weight.contiguous(), weight, weight.stride(0), out,
            normed if normed is not None else out, summed if residual is not None else out, n_out, k_in, eps,
            *(_conv_args(conv, conv_out) if conv is not None else (out, out, 0, 0, 0, out, out, 0)),
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, WRITE_NORMED=return_normed,
            ROWS=num_rows, ROWS_P2=pow2(num_rows), BLOCK_N=config.block_n, REPS=reps, CHUNK=chunk,
            BLOCK_D=pow2(k_in), PDL=pdl,
            CONV=conv is not None, WIDTH=conv.weight.shape[1] if conv is not None else 1,
            BLOCK_W=pow2(conv.weight.shape[1]) if conv is not None else 1,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
        )
    return out.reshape(*x.shape[:-1], n_out), normed, summed, conv_out


def _conv_args(conv: _Conv, conv_out: torch.Tensor) -> tuple:
    return (conv.weight.contiguous(), conv.state, *conv.state.stride(), conv.slots, conv_out, conv.weight.shape[0])


def add_rms_norm_gemv_tiled(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, return_normed: bool, config: GemvConfig, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm_gemv`` launched in the given shape (``benchmarks/normed_gemv_sweep.py``, the tests)."""
    return _launch(x, residual, norm_weight, eps, zero_centered, weight, return_normed, config, out_dtype)[:3]


# Under the interpreter, whose cost is per program and per operation: few, wide programs.
_INTERPRETER_CONFIG = GemvConfig(block_n=64, block_k=256, num_warps=4, pdl=False)


def add_rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, return_normed: bool = False, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    n_out, k_in = weight.shape
    num_rows = x.numel() // k_in if k_in else 0
    return add_rms_norm_gemv_tiled(x, residual, norm_weight, eps, zero_centered, weight, return_normed,
                                   _config(num_rows, n_out, k_in), out_dtype)


def _config(num_rows: int, n_out: int, k_in: int) -> GemvConfig:
    return _INTERPRETER_CONFIG if INTERPRETED else normed_gemv_config(num_rows, n_out, k_in)


def add_rms_norm_gemv_conv_tiled(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
    config: GemvConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``add_rms_norm_gemv_conv`` launched in the given shape."""
    channels, width = conv_weight.shape if conv_weight.dim() == 2 else (0, 0)
    rows = x.numel() // weight.shape[1] if weight.dim() == 2 and weight.shape[1] else 0
    if (
        x.dim() != 2
        or not 0 < channels <= weight.shape[0]
        or conv_state.dim() != 3
        or conv_state.shape[1:] != (channels, width - 1)
        or conv_state.dtype != x.dtype
        or state_slots.shape != (rows,)
    ):
        raise ValueError(
            f"add_rms_norm_gemv_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_weight "
            f"{tuple(conv_weight.shape)}, conv_state {tuple(conv_state.shape)} {conv_state.dtype}, state_slots "
            f"{tuple(state_slots.shape)} disagree"
        )
    out, _, summed, conv_out = _launch(x, residual, norm_weight, eps, zero_centered, weight, False, config,
                                       conv=_Conv(conv_weight, conv_state, state_slots))
    return out, conv_out, summed  # type: ignore[return-value]


def add_rms_norm_gemv_conv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, zero_centered: bool,
    weight: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_out, k_in = weight.shape
    config = _config(x.numel() // k_in if k_in else 0, n_out, k_in)
    return add_rms_norm_gemv_conv_tiled(x, residual, norm_weight, eps, zero_centered, weight, conv_weight,
                                        conv_state, state_slots, config)
