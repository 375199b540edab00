"""Triton RMSNorm kernels: plain / zero-centred, with a fused residual add, and the gated (SiLU or sigmoid) norm.

One program normalises a block of rows (one row of the hidden size, several head rows). Inputs may be strided views of up to three dims (``q`` and the
Gated DeltaNet gate ``z`` are slices of a packed projection): rows are addressed as ``(i, j)`` with
one stride each, the last dim must be unit-stride (otherwise it is copied). Rounding follows the
references: the sum of the residual add and the normalised value of the plain/gated norms are
rounded to the activations' dtype where the references round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.norm import check_gate_activation
from freetoken.kernels.triton._common import cast, device_function, new_empty, pow2, round_as, rows_per_program
from freetoken.kernels.triton.moe_decode import _pdl_available


@device_function
def apply_gate(y, g, GATE_SIGMOID: tl.constexpr):
    """``y`` gated by float32 ``g`` as the gated norm gates it: ``y · sigmoid(g)``, else ``y · silu(g)``."""
    if GATE_SIGMOID:
        gated = y * tl.sigmoid(g)
    else:
        gated = y * (g * tl.sigmoid(g))
    return gated


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_s0, x_s1,
    res_ptr, res_s0, res_s1,
    gate_ptr, gate_s0, gate_s1,
    w_ptr,
    out_ptr, sum_ptr,
    num_rows, inner, dim, eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    GATE_SIGMOID: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # every input may be an earlier launch's output: wait before any load, then let the next launch start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i = (rows // inner)[:, None]
    j = (rows % inner)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < num_rows)[:, None] & (cols < dim)
    # Arithmetic in float32 (Triton's interpreter cannot compute in bf16); ``round_as`` rounds where
    # the reference rounds.
    x = tl.load(x_ptr + i * x_s0 + j * x_s1 + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    out_offs = rows[:, None] * dim + cols
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * res_s0 + j * res_s1 + cols, mask=mask, other=0.0).to(tl.float32)
        xf = round_as(xf + r, x.dtype)
        tl.store(sum_ptr + out_offs, cast(xf, x.dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)[:, None]
    normed = xf * inv_rms
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = normed * (1.0 + w)
    else:
        y = round_as(w * round_as(normed, x.dtype), out_ptr.dtype.element_ty)
    if HAS_GATE:
        g = tl.load(gate_ptr + i * gate_s0 + j * gate_s1 + cols, mask=mask, other=0.0).to(tl.float32)
        y = apply_gate(y, g, GATE_SIGMOID)
    tl.store(out_ptr + out_offs, cast(y, out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``t`` as ``(tensor, outer, inner, stride_outer, stride_inner)`` over its rows (last dim unit-stride)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        t = t[None]
    if t.dim() == 2:
        return t, t.shape[0], 1, t.stride(0), 0
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])
    return t, t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    out_dtype: torch.dtype,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    gate_sigmoid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"norm weight has shape {tuple(weight.shape)}, expected ({dim},)")
    out = new_empty(x.shape, out_dtype, x.device)
    summed = new_empty(x.shape, x.dtype, x.device) if residual is not None else None
    xv, outer, inner, xs0, xs1 = _rows(x)
    rv, _, _, rs0, rs1 = _rows(residual) if residual is not None else (xv, 0, 0, 0, 0)
    gv, _, _, gs0, gs1 = _rows(gate) if gate is not None else (xv, 0, 0, 0, 0)
    num_rows = outer * inner
    if num_rows:
        block_d = pow2(dim)
        block_r = rows_per_program(num_rows, block_d)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            xv, xs0, xs1,
            rv, rs0, rs1,
            gv, gs0, gs1,
            weight.contiguous(),
            out, summed if summed is not None else out,
            num_rows, inner, dim, eps,
            HAS_RESIDUAL=residual is not None,
            HAS_GATE=gate is not None,
            GATE_SIGMOID=gate_sigmoid,
            ZERO_CENTERED=zero_centered,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            PDL=_pdl_available(),
            num_warps=4 if block_r * block_d <= 1024 else 8,
            launch_pdl=_pdl_available(),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    out_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    return _launch(x, weight, eps, zero_centered, out_dtype)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out_dtype = x.dtype if zero_centered else torch.promote_types(x.dtype, weight.dtype)
    out, summed = _launch(x, weight, eps, zero_centered, out_dtype, residual=residual)
    return out, summed


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str = "silu"
) -> torch.Tensor:
    check_gate_activation(activation)
    if gate.shape != x.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    return _launch(x, weight, eps, False, x.dtype, gate=gate, gate_sigmoid=activation == "sigmoid")[0]
