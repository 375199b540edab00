"""Triton ``gated_rms_norm_gemv``: the few-row GEMV with the Gated DeltaNet output norm (per head,
gated) in its prologue.

One program holds every row (at most ``gemv_configs.NORMED_MAX_ROWS``) and ``block_n`` weight rows.
A weight step is ``REPS`` whole heads of ``D`` columns (``[BLOCK_N, REPS, D]``): the program loads it,
and normalizes the step's heads of each row once (their sums of squares over ``D``, the gate's
``act``) into a ``[REPS, D]`` tile that the weight tile's rows share. The first weight step is
loaded before waiting for the previous launch (programmatic dependent launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.gemv import GEMV_DTYPES
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS, GemvConfig, gated_normed_gemv_config
from freetoken.kernels.norm import check_gate_activation
from freetoken.kernels.triton._common import INTERPRETED, cast, device_function, new_empty, pow2, round_as
from freetoken.kernels.triton.moe_decode import _pdl_available


@device_function
def _gated_step(acc, w, k, x_ptr, x_st, g_ptr, g_st, nw, m, K, D, eps,
                GATE_SIGMOID: tl.constexpr, ROWS: tl.constexpr):
    """``acc [BLOCK_N, ROWS_P2] +=`` the weight step ``w [BLOCK_N, REPS, BLOCK_D]`` against each row's
    gated, normalized head columns ``k [REPS, BLOCK_D]`` (``_rms_norm_kernel``'s roundings)."""
    dtype = x_ptr.dtype.element_ty
    k_ok = k < K  # the padding columns of a head (past D) come in as K
    wf = w.to(tl.float32)
    for i in tl.static_range(ROWS):
        xf = tl.load(x_ptr + i * x_st + k, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + i * g_st + k, mask=k_ok, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        y = round_as(nw * round_as(xf * inv_rms, dtype), dtype)
        if GATE_SIGMOID:
            y = y * tl.sigmoid(g)
        else:
            y = y * (g * tl.sigmoid(g))
        part = tl.sum(tl.sum(wf * round_as(y, dtype)[None, :, :], 2), 1)
        acc = tl.where((m == i)[None, :], acc + part[:, None], acc)
    return acc


@triton.jit
def _gated_norm_gemv_kernel(
    x_ptr, x_st, g_ptr, g_st, nw_ptr, w_ptr, w_st, out_ptr, N, K, D, eps,
    GATE_SIGMOID: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    REPS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next launch may start: its programs take the slots these leave
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N - 1 again (see _gemv_kernel); the weights are read once: evict_first.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None, None] * w_st
    d = tl.arange(0, BLOCK_D)
    cols = (tl.arange(0, REPS) * D)[:, None] + d[None, :]  # [REPS, BLOCK_D]: REPS heads
    d_ok = (d < D)[None, :]
    STEP = REPS * D
    # The first weight step is loaded before the wait: the model never writes its weights.
    w = tl.load(w_rows + cols[None, :, :], mask=((cols < K) & d_ok)[None, :, :], other=0.0,
                eviction_policy="evict_first")
    if PDL:  # the core and the gate are earlier launches' outputs
        tl.extra.cuda.gdc_wait()
    nw = tl.load(nw_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    m = tl.arange(0, ROWS_P2)
    acc = tl.zeros([BLOCK_N, ROWS_P2], tl.float32)
    acc = _gated_step(acc, w, tl.where(d_ok, cols, K), x_ptr, x_st, g_ptr, g_st, nw, m, K, D, eps,
                      GATE_SIGMOID, ROWS)
    for k0 in range(STEP, K, STEP):
        k = k0 + cols
        ok = (k < K) & d_ok
        w = tl.load(w_rows + k[None, :, :], mask=ok[None, :, :], other=0.0, eviction_policy="evict_first")
        acc = _gated_step(acc, w, tl.where(ok, k, K), x_ptr, x_st, g_ptr, g_st, nw, m, K, D, eps,
                          GATE_SIGMOID, ROWS)
    dtype = x_ptr.dtype.element_ty
    tl.store(out_ptr + m[None, :] * N + n[:, None], cast(acc, dtype), mask=(n < N)[:, None] & (m < ROWS)[None, :])


def _check(x, gate, norm_weight, activation, weight) -> None:
    check_gate_activation(activation)
    if x.dim() != 3 or gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm_gemv: x {tuple(x.shape)} and gate {tuple(gate.shape)} must be one [T, H, D] shape")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] * x.shape[2]:
        raise ValueError(f"gated_rms_norm_gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree")
    if x.dtype != weight.dtype or x.dtype not in GEMV_DTYPES or gate.dtype != x.dtype:
        raise ValueError(f"gated_rms_norm_gemv: x {x.dtype}, gate {gate.dtype} and weight {weight.dtype} must be one "
                         f"of {GEMV_DTYPES}, the same")
    if norm_weight.shape != (x.shape[2],):
        raise ValueError(f"gated_rms_norm_gemv: norm_weight has shape {tuple(norm_weight.shape)}, expected ({x.shape[2]},)")
    if x.shape[0] > NORMED_MAX_ROWS:
        raise ValueError(f"gated_rms_norm_gemv: {x.shape[0]} rows, at most {NORMED_MAX_ROWS} (one program holds them)")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` with each row's ``H·D`` values contiguous (a row stride free)."""
    rows = t.reshape(t.shape[0], -1)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gated_rms_norm_gemv_tiled(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str, weight: torch.Tensor,
    config: GemvConfig,
) -> torch.Tensor:
    """``gated_rms_norm_gemv`` launched in the given shape (``benchmarks/gated_norm_gemv_sweep.py``, the tests):
    ``config.block_k`` 2-byte columns a step, whole heads (at least one)."""
    _check(x, gate, norm_weight, activation, weight)
    num_rows, _, head_dim = x.shape
    n_out, k_in = weight.shape
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    if num_rows and n_out:
        xr, gr = _rows(x), _rows(gate)
        if weight.stride(-1) != 1:
            weight = weight.contiguous()
        pdl = config.pdl and _pdl_available()
        block_d = pow2(head_dim)
        reps = max(1, config.block_k * 2 // weight.element_size() // block_d)
        _gated_norm_gemv_kernel[(triton.cdiv(n_out, config.block_n),)](
            xr, xr.stride(0), gr, gr.stride(0), norm_weight.contiguous(), weight, weight.stride(0), out,
            n_out, k_in, head_dim, eps,
            GATE_SIGMOID=activation == "sigmoid", ROWS=num_rows, ROWS_P2=pow2(num_rows), BLOCK_N=config.block_n,
            REPS=reps, BLOCK_D=block_d, PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages,
            launch_pdl=pdl,
        )
    return out


# Under the interpreter, whose cost is per program and per operation: few, wide programs.
_INTERPRETER_CONFIG = GemvConfig(block_n=64, block_k=256, num_warps=4, pdl=False)


def gated_rms_norm_gemv(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str, weight: torch.Tensor
) -> torch.Tensor:
    n_out, k_in = weight.shape
    config = _INTERPRETER_CONFIG if INTERPRETED else gated_normed_gemv_config(x.shape[0], n_out, k_in)
    return gated_rms_norm_gemv_tiled(x, gate, norm_weight, eps, activation, weight, config)
