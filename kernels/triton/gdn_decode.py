"""Triton Gated DeltaNet decode step with the gating computed in the kernel.

One program per (request, value head, block of value columns), as ``gated_delta_rule_decode``; each
also computes its head's ``β = sigmoid(b)`` (rounded to the activations' dtype, as the reference)
and ``g = -exp(A_log) · softplus(a + dt_bias)`` in float32 (softplus with torch's threshold of 20),
so the layer's eight small gating launches go.

Under programmatic dependent launch a program loads its state tile before it waits for the launch
before (``griddepcontrol.wait``): the tile crosses HBM while the ``in_proj`` GEMV drains. That
holds because no launch that may still be running writes a layer's recurrent state: only this
layer's own decode launch of the step before does (or the step's slot resets and snapshot
restores, which run as stream-ordered copies before the forward's first launch), and a launch
starts early only under its predecessor's ``gdc_launch_dependents``.

With ``NORM`` the layer's gated output RMS norm runs in the epilogue too
(``gated_delta_rule_decode_gated_norm``), on the step's own programs: each stores its columns of the
step's output (rounded to the activations' dtype, as the unfused step stores them) and arrives at
its (request, head) counter; the last of the head's programs to arrive reads the head's whole row
back from L2 and stores it normed and gated, rounded where the unfused decode + ``gated_rms_norm``
round it. The state still streams through every program of the unfused step (session 21's version
gave each head one program with the whole 128 x 128 state tile: 32 programs a layer at batch 1,
slower than the norm launch it saved).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.norm import check_gate_activation
from freetoken.kernels.triton._common import arrive, cast, device_function, new_empty, pow2, round_as, zeroed_counters
from freetoken.kernels.triton.moe_decode import _pdl_available
from freetoken.kernels.triton.norm import apply_gate

# Value columns per program and warps: below ``WIDE_BATCH`` requests (B=1: 4.3 us on the H200)
# ``BLOCK_V`` over 4 warps; from it ``WIDE_BLOCK_V`` over 4 warps, fewer programs for the same state
# traffic (B=16/64/128: 21.7/75.5/149.7 us against 22.8/85.5/169.4; benchmarks/gdn_decode_sweep.py).
BLOCK_V = 32
WIDE_BATCH, WIDE_BLOCK_V = 16, 64
NUM_WARPS = 4


def decode_tiles(batch: int, value_dim: int) -> int:
    """The ``BLOCK_V`` of a decode step of ``batch`` requests (``NUM_WARPS`` warps at every size)."""
    return min(pow2(value_dim), WIDE_BLOCK_V if batch >= WIDE_BATCH else BLOCK_V)


@triton.jit
def _decode_gated_kernel(
    q_ptr, q_sb, q_sh, k_ptr, k_sb, k_sh, v_ptr, v_sb, v_sh,
    a_ptr, a_sb, b_ptr, b_sb, a_log_ptr, dt_bias_ptr,
    state_ptr, st_ss, st_sh, st_sk, slot_ptr, out_ptr,
    z_ptr, z_sb, z_sh, norm_w_ptr, eps, count_ptr,
    num_v_heads, key_dim, value_dim, q_scale,
    HEAD_RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr = False, BLOCK_ROW: tl.constexpr = 1, GATE_SIGMOID: tl.constexpr = False,
    ROUND_PRODUCT: tl.constexpr = True,
):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // HEAD_RATIO
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    dtype = out_ptr.dtype.element_ty
    # The state tile is loaded before the wait: no launch that may still run writes it (see the
    # module's docstring), and it is the launch's bytes.
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    s_ptrs = state_ptr + slot * st_ss + h * st_sh + kcols[:, None] * st_sk + vcols[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    if PDL:  # the other inputs may be the launch before's outputs; then the next launch may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    beta = round_as(tl.sigmoid(tl.load(b_ptr + bi * b_sb + h).to(tl.float32)), b_ptr.dtype.element_ty)
    # dt_bias in its own dtype, added in float32 (the reference promotes a.float() + dt_bias).
    x = tl.load(a_ptr + bi * a_sb + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    q = tl.load(q_ptr + bi * q_sb + kh * q_sh + kcols, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + bi * k_sb + kh * k_sh + kcols, mask=k_ok, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + bi * v_sb + h * v_sh + vcols, mask=v_ok, other=0.0).to(tl.float32)
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], 0)
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(s_ptrs, s, mask=s_mask)
    out_row = out_ptr + (bi * num_v_heads + h) * value_dim
    tl.store(out_row + vcols, cast(tl.sum(s * q[:, None], 0), dtype), mask=v_ok)
    if NORM:  # the last of the head's programs: the gated output norm over its whole row
        if arrive(count_ptr + bi * num_v_heads + h, tl.num_programs(2)):
            _gated_norm_row(out_row, z_ptr + bi * z_sb + h * z_sh, norm_w_ptr, eps, value_dim,
                            BLOCK_ROW, GATE_SIGMOID, ROUND_PRODUCT)


@device_function
def _gated_norm_row(row_ptr, z_row, norm_w_ptr, eps, value_dim, BLOCK_ROW: tl.constexpr,
                    GATE_SIGMOID: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    """``row`` (the step's output, stored by the head's programs) normed and gated in place, as
    ``_rms_norm_kernel`` rounds it: ``x̂`` and, unless the weight's dtype is wider, ``w · x̂`` in the
    activations' dtype; the gate in float32."""
    dtype = row_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_ROW)
    ok = cols < value_dim
    core = tl.load(row_ptr + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    normed = round_as(core * tl.rsqrt(tl.sum(core * core, 0) / value_dim + eps), dtype)
    out = tl.load(norm_w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed
    if ROUND_PRODUCT:
        out = round_as(out, dtype)
    z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(row_ptr + cols, cast(apply_gate(out, z, GATE_SIGMOID), dtype), mask=ok)


def _check(q, k, v, a, b, A_log, dt_bias, state) -> None:
    batch, num_v_heads, value_dim = v.shape
    num_k_heads, key_dim = k.shape[1:]
    if (
        q.shape != k.shape
        or num_v_heads % num_k_heads
        or a.shape != (batch, num_v_heads)
        or b.shape != (batch, num_v_heads)
        or A_log.shape != (num_v_heads,)
        or dt_bias.shape != (num_v_heads,)
        or state.shape[1:] != (num_v_heads, key_dim, value_dim)
        or state.dtype != torch.float32
        or state.stride(-1) != 1
    ):
        raise ValueError(
            f"gated delta rule decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}, "
            f"state {tuple(state.shape)} {state.dtype} disagree"
        )


def _launch(q, k, v, a, b, A_log, dt_bias, state, state_slots, norm=None) -> torch.Tensor:
    """The step's launch over ``(request, value head, block of value columns)``; ``norm``:
    ``(z, weight, eps, activation)`` of the output norm run in its epilogue."""
    batch, num_v_heads, value_dim = v.shape
    num_k_heads, key_dim = k.shape[1:]
    q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    out = new_empty((batch, num_v_heads, value_dim), v.dtype, v.device)
    if batch == 0:
        return out
    if norm is None:
        z, norm_w, eps, counters, extra = v, A_log, 0.0, out, {}
    else:
        z, norm_w, eps, activation = norm
        z, norm_w = (z if z.stride(-1) == 1 else z.contiguous()), norm_w.contiguous()
        counters = zeroed_counters(v.device, "gdn_decode_norm", batch * num_v_heads)
        extra = dict(NORM=True, BLOCK_ROW=pow2(value_dim), GATE_SIGMOID=activation == "sigmoid",
                     ROUND_PRODUCT=torch.promote_types(norm_w.dtype, v.dtype) == v.dtype)
    block_v = decode_tiles(batch, value_dim)
    _decode_gated_kernel[(batch, num_v_heads, triton.cdiv(value_dim, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        a, a.stride(0), b, b.stride(0), A_log, dt_bias,
        state, state.stride(0), state.stride(1), state.stride(2), state_slots, out,
        z, z.stride(0), z.stride(1), norm_w, eps, counters,
        num_v_heads, key_dim, value_dim, key_dim**-0.5,
        HEAD_RATIO=num_v_heads // num_k_heads, BLOCK_K=pow2(key_dim), BLOCK_V=block_v, num_warps=NUM_WARPS,
        PDL=_pdl_available(), launch_pdl=_pdl_available(), **extra,
    )
    return out


def gated_delta_rule_decode_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    _check(q, k, v, a, b, A_log, dt_bias, state)
    return _launch(q, k, v, a, b, A_log, dt_bias, state, state_slots)


def gated_delta_rule_decode_gated_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    activation: str = "silu",
) -> torch.Tensor:
    _check(q, k, v, a, b, A_log, dt_bias, state)
    check_gate_activation(activation)
    value_dim = v.shape[2]
    if z.shape != v.shape or norm_weight.shape != (value_dim,):
        raise ValueError(
            f"gated delta rule decode + norm: z {tuple(z.shape)} must be v's {tuple(v.shape)}, "
            f"norm weight {tuple(norm_weight.shape)} ({value_dim},)"
        )
    return _launch(q, k, v, a, b, A_log, dt_bias, state, state_slots, (z, norm_weight, eps, activation))
