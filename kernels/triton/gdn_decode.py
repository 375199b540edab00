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
``[Dk, Dv]`` states, one value head after the other, the next one's load issued before the current
one computes. Every other read (conv windows, gates, ``z``, the first state) is issued up front,
so the program waits for memory about twice, not once per dependent step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.norm import check_gate_activation
from freetoken.kernels.triton._common import cast, device_function, new_empty, pow2, round_as

BLOCK_V = 32
# Warps of gated_deltanet_decode; None: one per 1024 elements of a state, 1 to 16 (16 for 128 x 128:
# 128 registers, no spills at sm_90; 8 fit too at 255; 4 spill).
# A module constant so benchmarks/fuse_decode_chain.py can try others.
NUM_WARPS: int | None = None


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
def _conv_window(x_row, w_ptr, state_base, cs_sc, cs_sk, channels, ok,
                 WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, dtype: tl.constexpr):
    """The windows (``state ++ x``, as read) of the channels ``channels [R, C]`` and their
    ``silu(conv)`` as ``causal_conv1d_decode`` computes it (rounded to ``dtype``, held in float32)."""
    j = tl.arange(0, BLOCK_W)[None, None, :]
    ch = channels[:, :, None]
    m = ok[:, :, None]
    window = tl.load(state_base + ch * cs_sc + j * cs_sk, mask=m & (j < WIDTH - 1), other=0.0)
    x = tl.load(x_row + channels, mask=ok, other=0.0)
    window = tl.where(j == WIDTH - 1, x[:, :, None], window)
    w = tl.load(w_ptr + ch * WIDTH + j, mask=m & (j < WIDTH), other=0.0)
    wdtype = w_ptr.dtype.element_ty
    acc = round_as(tl.sum(round_as(window.to(tl.float32) * w.to(tl.float32), wdtype), 2), wdtype)
    return window, round_as(acc * tl.sigmoid(acc), dtype)


@device_function
def _move_window_on(window, state_base, cs_sc, cs_sk, channels, ok, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Store ``window [R, C, BLOCK_W]`` one token on: ``state[j] = window[j + 1]``."""
    j = tl.arange(0, BLOCK_W)[None, None, :]
    mask = ok[:, :, None] & (j >= 1) & (j < WIDTH)
    tl.store(state_base + channels[:, :, None] * cs_sc + (j - 1) * cs_sk, window, mask=mask)


@device_function
def _row(tile, rows, r):
    """Row ``r`` of ``tile [R, C]`` (``rows = arange(R)``), exactly."""
    return tl.sum(tl.where(rows[:, None] == r, tile, 0.0), 0)


@triton.jit
def _deltanet_decode_kernel(
    x_ptr, x_sb, z_ptr, z_sb, z_sh, a_ptr, a_sb, b_ptr, b_sb,
    cw_ptr, a_log_ptr, dt_bias_ptr, nw_ptr,
    cs_ptr, cs_ss, cs_sc, cs_sk, st_ptr, st_ss, st_sh, st_sk, slot_ptr, out_ptr,
    num_k_heads, num_v_heads, key_dim, value_dim, q_scale, eps,
    HEAD_RATIO: tl.constexpr, WIDTH: tl.constexpr, GATE_SIGMOID: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
    TINY_STATE: tl.constexpr,
):
    bi = tl.program_id(0)
    kh = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    x_row = x_ptr + bi * x_sb
    conv_base = cs_ptr + slot * cs_ss
    # Everything the program reads, first, so the loads overlap: the conv windows of key head kh's
    # q (row 0) and k (row 1) channels, kh·Dk + c and Hk·Dk + kh·Dk + c, and of its value heads'
    # v channels; their gates, z, and the first value head's state.
    part = tl.arange(0, 2)
    kcols = tl.arange(0, BLOCK_K)
    k_ok = kcols < key_dim
    qk_channels = part[:, None] * (num_k_heads * key_dim) + kh * key_dim + kcols[None, :]
    qk_ok = (part[:, None] < 2) & k_ok[None, :]
    qk_window, qk = _conv_window(x_row, cw_ptr, conv_base, cs_sc, cs_sk, qk_channels, qk_ok, WIDTH, BLOCK_W, dtype)
    rows = tl.arange(0, BLOCK_R)
    heads = kh * HEAD_RATIO + rows
    h_ok = rows < HEAD_RATIO
    vcols = tl.arange(0, BLOCK_V)
    v_ok = vcols < value_dim
    hv_ok = h_ok[:, None] & v_ok[None, :]
    v_channels = 2 * num_k_heads * key_dim + heads[:, None] * value_dim + vcols[None, :]
    v_window, v_all = _conv_window(x_row, cw_ptr, conv_base, cs_sc, cs_sk, v_channels, hv_ok, WIDTH, BLOCK_W, dtype)
    z_all = tl.load(z_ptr + bi * z_sb + heads[:, None] * z_sh + vcols[None, :], mask=hv_ok, other=0.0).to(tl.float32)
    # The gating of every value head, as gated_delta_rule_decode_gated computes it.
    beta_all = round_as(tl.sigmoid(tl.load(b_ptr + bi * b_sb + heads, mask=h_ok, other=0.0).to(tl.float32)),
                        b_ptr.dtype.element_ty)
    xa = (tl.load(a_ptr + bi * a_sb + heads, mask=h_ok, other=0.0).to(tl.float32)
          + tl.load(dt_bias_ptr + heads, mask=h_ok, other=0.0).to(tl.float32))
    softplus = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(tl.minimum(xa, 20.0))))
    decay_all = tl.exp(-tl.exp(tl.load(a_log_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)) * softplus)
    norm_w = tl.load(nw_ptr + vcols, mask=v_ok, other=0.0).to(tl.float32)
    s_mask = k_ok[:, None] & v_ok[None, :]
    s_offs = kcols[:, None] * st_sk + vcols[None, :]
    state_base = st_ptr + slot * st_ss + kh * HEAD_RATIO * st_sh
    s_next = tl.load(state_base + s_offs, mask=s_mask, other=0.0)
    # Every thread has read its part of the windows before any is moved on (a small tile's elements
    # may be held by several threads; the values stored are the ones read, so nothing else orders it).
    tl.debug_barrier()
    _move_window_on(qk_window, conv_base, cs_sc, cs_sk, qk_channels, qk_ok, WIDTH, BLOCK_W)
    _move_window_on(v_window, conv_base, cs_sc, cs_sk, v_channels, hv_ok, WIDTH, BLOCK_W)
    q = _row(qk, part, 0)
    k = _row(qk, part, 1)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    for r in tl.static_range(HEAD_RATIO):
        s_ptrs = state_base + r * st_sh + s_offs
        s = s_next * tl.sum(tl.where(rows == r, decay_all, 0.0), 0)
        if r + 1 < HEAD_RATIO:  # the next head's state in flight while this one computes
            s_next = tl.load(s_ptrs + st_sh, mask=s_mask, other=0.0)
        # The delta-rule step. Each stored element depends on its column's elements read (through
        # the reduction), so the update in place needs no barrier, unless a state is smaller than
        # the program's threads and so held by several (TINY_STATE).
        predicted = tl.sum(s * k[:, None], 0)
        beta = tl.sum(tl.where(rows == r, beta_all, 0.0), 0)
        s = s + k[:, None] * ((_row(v_all, rows, r) - predicted) * beta)[None, :]
        if TINY_STATE:
            tl.debug_barrier()
        tl.store(s_ptrs, s, mask=s_mask)
        core = round_as(tl.sum(s * q[:, None], 0), dtype)
        # The gated output norm, as gated_rms_norm: (w · x̂) rounded, then the gate in float32.
        inv_rms = tl.rsqrt(tl.sum(core * core, 0) / value_dim + eps)
        y = round_as(norm_w * round_as(core * inv_rms, dtype), dtype)
        zg = _row(z_all, rows, r)
        if GATE_SIGMOID:
            y = y * tl.sigmoid(zg)
        else:
            y = y * (zg * tl.sigmoid(zg))
        tl.store(out_ptr + (bi * num_v_heads + kh * HEAD_RATIO + r) * value_dim + vcols, cast(y, dtype), mask=v_ok)


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
    num_warps = NUM_WARPS or min(16, max(1, block_k * block_v // 1024))
    _deltanet_decode_kernel[(batch, num_k_heads)](
        mixed_qkv, mixed_qkv.stride(0), z, z.stride(0), z.stride(1), a, a.stride(0), b, b.stride(0),
        conv_weight, A_log, dt_bias, norm_weight,
        conv_state, *conv_state.stride(), recurrent_state, *recurrent_state.stride()[:3], state_slots, out,
        num_k_heads, num_v_heads, key_dim, value_dim, key_dim**-0.5, eps,
        HEAD_RATIO=head_ratio, WIDTH=width, GATE_SIGMOID=gate_activation == "sigmoid",
        BLOCK_R=pow2(head_ratio), BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_W=pow2(width),
        TINY_STATE=block_k * block_v < 32 * num_warps, num_warps=num_warps,
    )
    return out
