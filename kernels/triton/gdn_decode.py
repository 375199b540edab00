"""Triton Gated DeltaNet decode steps: the delta-rule step with the gating computed in the kernel,
and the layer's whole decode chain in one launch.

``gated_delta_rule_decode_gated``: one program per (request, value head, block of value columns),
as ``gated_delta_rule_decode``; each also computes its head's ``β = sigmoid(b)`` (rounded to the
activations' dtype, as the reference) and ``g = -exp(A_log) · softplus(a + dt_bias)`` in float32
(softplus with torch's threshold of 20), so the layer's eight small gating launches go.

``gated_deltanet_decode``: one program per (request, key head). The program owns every channel
its heads read: the key head's q and k conv channels and the v channels of the value heads that
share that key head, so each conv window is read and moved on by exactly one program (a program
per value head would have two programs of a key head read q/k windows another may already have
moved on). The gated norm needs a value head's whole output row, so a program holds whole
``[Dk, Dv]`` states: ``BLOCK_H`` value heads at a time, as many as fit ``STATE_TILE`` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.norm import check_gate_activation
from freetoken.kernels.triton._common import cast, device_function, new_empty, pow2, round_as

BLOCK_V = 32
# float32 state elements one program of gated_deltanet_decode holds at once (registers: 64 per
# thread at 8 warps); a module constant so benchmarks/fuse_decode_chain.py can try others.
STATE_TILE = 16384
NUM_WARPS: int | None = None  # None: one warp per 2048 state elements, 4 to 16


@triton.jit
def _decode_gated_kernel(
    q_ptr, q_sb, q_sh, k_ptr, k_sb, k_sh, v_ptr, v_sb, v_sh,
    a_ptr, a_sb, b_ptr, b_sb, a_log_ptr, dt_bias_ptr,
    state_ptr, st_ss, st_sh, st_sk, slot_ptr, out_ptr,
    num_v_heads, key_dim, value_dim, q_scale,
    HEAD_RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    bi = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // HEAD_RATIO
    vcols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    dtype = out_ptr.dtype.element_ty
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
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    s_ptrs = state_ptr + slot * st_ss + h * st_sh + kcols[:, None] * st_sk + vcols[None, :]
    s_mask = k_ok[:, None] & v_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(s * k[:, None], 0)
    s = s + k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(s_ptrs, s, mask=s_mask)
    out = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + (bi * num_v_heads + h) * value_dim + vcols, cast(out, dtype), mask=v_ok)


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
    q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    out = new_empty((batch, num_v_heads, value_dim), v.dtype, v.device)
    if batch == 0:
        return out
    block_v = min(pow2(value_dim), BLOCK_V)
    _decode_gated_kernel[(batch, num_v_heads, triton.cdiv(value_dim, block_v))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        a, a.stride(0), b, b.stride(0), A_log, dt_bias,
        state, state.stride(0), state.stride(1), state.stride(2), state_slots, out,
        num_v_heads, key_dim, value_dim, key_dim**-0.5,
        HEAD_RATIO=num_v_heads // num_k_heads, BLOCK_K=pow2(key_dim), BLOCK_V=block_v, num_warps=4,
    )
    return out


@device_function
def _conv_step(x_row, w_ptr, state_base, cs_sc, cs_sk, channels, ok,
               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, dtype: tl.constexpr):
    """``silu(conv)`` of the channels ``channels [R, C]`` (rounded to ``dtype``, held in float32),
    as ``causal_conv1d_decode``; their windows (``state ++ x``) move on by one token in place."""
    j = tl.arange(0, BLOCK_W)[None, None, :]
    ch = channels[:, :, None]
    m = ok[:, :, None]
    window = tl.load(state_base + ch * cs_sc + j * cs_sk, mask=m & (j < WIDTH - 1), other=0.0)
    x = tl.load(x_row + channels, mask=ok, other=0.0)
    window = tl.where(j == WIDTH - 1, x[:, :, None], window)
    w = tl.load(w_ptr + ch * WIDTH + j, mask=m & (j < WIDTH), other=0.0)
    wdtype = w_ptr.dtype.element_ty
    acc = round_as(tl.sum(round_as(window.to(tl.float32) * w.to(tl.float32), wdtype), 2), wdtype)
    # Every thread has read its part of the windows before any part is overwritten (a small tile's
    # elements may be held by several threads); the stored values are the ones read, unconverted.
    tl.debug_barrier()
    tl.store(state_base + ch * cs_sc + (j - 1) * cs_sk, window, mask=m & (j >= 1) & (j < WIDTH))
    return round_as(acc * tl.sigmoid(acc), dtype)


@triton.jit
def _deltanet_decode_kernel(
    x_ptr, x_sb, z_ptr, z_sb, z_sh, a_ptr, a_sb, b_ptr, b_sb,
    cw_ptr, a_log_ptr, dt_bias_ptr, nw_ptr,
    cs_ptr, cs_ss, cs_sc, cs_sk, st_ptr, st_ss, st_sh, st_sk, slot_ptr, out_ptr,
    num_k_heads, num_v_heads, key_dim, value_dim, q_scale, eps,
    HEAD_RATIO: tl.constexpr, WIDTH: tl.constexpr, GATE_SIGMOID: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
):
    bi = tl.program_id(0)
    kh = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    x_row = x_ptr + bi * x_sb
    conv_base = cs_ptr + slot * cs_ss
    # q (row 0) and k (row 1) of key head kh: channels kh·Dk + c and Hk·Dk + kh·Dk + c.
    part = tl.arange(0, 2)[:, None]
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    qk_channels = part * (num_k_heads * key_dim) + kh * key_dim + kcols[None, :]
    qk = _conv_step(x_row, cw_ptr, conv_base, cs_sc, cs_sk, qk_channels, (part < 2) & k_ok[None, :],
                    WIDTH, BLOCK_W, dtype)
    q = tl.sum(tl.where(part == 0, qk, 0.0), 0)
    k = tl.sum(tl.where(part == 1, qk, 0.0), 0)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    vcols = tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    norm_w = tl.load(nw_ptr + vcols, mask=v_ok, other=0.0).to(tl.float32)
    for h0 in tl.static_range(0, HEAD_RATIO, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        h_ok = hh < HEAD_RATIO
        h = kh * HEAD_RATIO + hh  # this block's value heads
        hv_ok = h_ok[:, None] & v_ok[None, :]
        v_channels = 2 * num_k_heads * key_dim + h[:, None] * value_dim + vcols[None, :]
        v = _conv_step(x_row, cw_ptr, conv_base, cs_sc, cs_sk, v_channels, hv_ok, WIDTH, BLOCK_W, dtype)
        # The gating, as gated_delta_rule_decode_gated computes it.
        beta = round_as(tl.sigmoid(tl.load(b_ptr + bi * b_sb + h, mask=h_ok, other=0.0).to(tl.float32)),
                        b_ptr.dtype.element_ty)
        xa = (tl.load(a_ptr + bi * a_sb + h, mask=h_ok, other=0.0).to(tl.float32)
              + tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32))
        softplus = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
        g = -tl.exp(tl.load(a_log_ptr + h, mask=h_ok, other=0.0).to(tl.float32)) * softplus
        # The delta-rule step on the [BLOCK_H, Dk, Dv] states.
        s_ptrs = (st_ptr + slot * st_ss + h[:, None, None] * st_sh + kcols[None, :, None] * st_sk
                  + vcols[None, None, :])
        s_mask = h_ok[:, None, None] & k_ok[None, :, None] & v_ok[None, None, :]
        s = tl.load(s_ptrs, mask=s_mask, other=0.0) * tl.exp(g)[:, None, None]
        predicted = tl.sum(s * k[None, :, None], 1)
        s = s + k[None, :, None] * ((v - predicted) * beta[:, None])[:, None, :]
        tl.debug_barrier()  # every thread has read its part of the states (see _conv_step)
        tl.store(s_ptrs, s, mask=s_mask)
        core = round_as(tl.sum(s * q[None, :, None], 1), dtype)
        # The gated output norm, as gated_rms_norm: (w · x̂) rounded, then the gate in float32.
        inv_rms = tl.rsqrt(tl.sum(core * core, 1) / value_dim + eps)
        y = round_as(norm_w[None, :] * round_as(core * inv_rms[:, None], dtype), dtype)
        zg = tl.load(z_ptr + bi * z_sb + h[:, None] * z_sh + vcols[None, :], mask=hv_ok, other=0.0).to(tl.float32)
        if GATE_SIGMOID:
            y = y * tl.sigmoid(zg)
        else:
            y = y * (zg * tl.sigmoid(zg))
        tl.store(out_ptr + (bi * num_v_heads + h[:, None]) * value_dim + vcols[None, :], cast(y, dtype), mask=hv_ok)


def gated_deltanet_decode(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    state_slots: torch.Tensor,
    gate_activation: str = "silu",
) -> torch.Tensor:
    check_gate_activation(gate_activation)
    batch, channels = mixed_qkv.shape
    num_v_heads, key_dim, value_dim = recurrent_state.shape[1:]
    width = conv_weight.shape[-1]
    key_channels = channels - num_v_heads * value_dim
    num_k_heads = key_channels // (2 * key_dim) if key_channels > 0 else 0
    if (
        num_k_heads == 0
        or key_channels != 2 * num_k_heads * key_dim
        or num_v_heads % num_k_heads
        or z.shape != (batch, num_v_heads, value_dim)
        or a.shape != (batch, num_v_heads)
        or b.shape != (batch, num_v_heads)
        or conv_weight.shape != (channels, width)
        or conv_state.shape[1:] != (channels, width - 1)
        or A_log.shape != (num_v_heads,)
        or dt_bias.shape != (num_v_heads,)
        or norm_weight.shape != (value_dim,)
        or recurrent_state.dtype != torch.float32
        or recurrent_state.stride(-1) != 1
        or state_slots.shape != (batch,)
    ):
        raise ValueError(
            f"gated deltanet decode: mixed_qkv {tuple(mixed_qkv.shape)}, z {tuple(z.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, conv_weight {tuple(conv_weight.shape)}, conv_state {tuple(conv_state.shape)}, "
            f"A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)}, norm_weight {tuple(norm_weight.shape)}, "
            f"recurrent_state {tuple(recurrent_state.shape)} {recurrent_state.dtype}, "
            f"state_slots {tuple(state_slots.shape)} disagree"
        )
    mixed_qkv, z, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (mixed_qkv, z, a, b))
    conv_weight, A_log, dt_bias, norm_weight = (t.contiguous() for t in (conv_weight, A_log, dt_bias, norm_weight))
    out = new_empty((batch, num_v_heads, value_dim), mixed_qkv.dtype, mixed_qkv.device)
    if batch == 0:
        return out
    head_ratio = num_v_heads // num_k_heads
    block_k, block_v = pow2(key_dim), pow2(value_dim)
    block_h = min(pow2(head_ratio), max(1, STATE_TILE // (block_k * block_v)))
    _deltanet_decode_kernel[(batch, num_k_heads)](
        mixed_qkv, mixed_qkv.stride(0), z, z.stride(0), z.stride(1), a, a.stride(0), b, b.stride(0),
        conv_weight, A_log, dt_bias, norm_weight,
        conv_state, *conv_state.stride(), recurrent_state, *recurrent_state.stride()[:3], state_slots, out,
        num_k_heads, num_v_heads, key_dim, value_dim, key_dim**-0.5, eps,
        HEAD_RATIO=head_ratio, WIDTH=width, GATE_SIGMOID=gate_activation == "sigmoid",
        BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_W=pow2(width),
        num_warps=NUM_WARPS or min(16, max(4, block_h * block_k * block_v // 2048)),
    )
    return out
