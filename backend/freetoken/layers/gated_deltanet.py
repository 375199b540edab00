"""Gated DeltaNet linear attention (Qwen3.5 / Qwen4-Exp ``linear_attn``) with per-request state slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.kernels.prefill_snapshots import PrefillSnapshots
from freetoken.layers.linear import linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.normed_linear import fuses, normed_linear
from freetoken.layers.slot_state import StateShapes
from freetoken.layers.weights import WeightTarget, new_param, packed_targets


# In a decode-only step whose input norm folds into in_proj's GEMV (``layers.normed_linear``), the
# conv1d decode step runs in that launch too (``kernels.add_rms_norm_gemv_conv``: each program
# convolves its own q|k|v channels): one launch a layer fewer. False: the A/B switch.
FUSED_CONV = True
# In a decode-only step the gated output norm runs in the delta-rule step's epilogue
# (``kernels.gated_delta_rule_decode_gated_norm``: the last of a head's programs to finish normalizes
# the head's row): one launch a layer fewer, out_proj a plain GEMV; up to ``DECODE_NORM_MAX_ROWS``
# requests. Measured (session 36, H100, ``benchmarks/b1_fusions_sweep.py --parts decode_norm``): 3.96
# us a layer against 4.64 for the step and the norm launch at 1 request, even from 4 to 32, 106
# against 102 at 64 and 215 against 199 at 128. False: the A/B switch.
FUSED_DECODE_NORM = True
DECODE_NORM_MAX_ROWS = 8


@dataclass(frozen=True)
class DeltaNetSizes:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # width of the causal conv1d
    eps: float  # of the gated output RMSNorm


class GatedDeltaNet(nn.Module):
    """``in_proj_{qkv,z,b,a}`` (one packed GEMM) -> causal conv1d + SiLU over q|k|v -> gated delta
    rule -> gated RMSNorm with ``z`` -> ``out_proj``.

    State per request slot: the conv window ``[C, K-1]`` (activations' dtype) and the recurrent
    state ``[Hv, Dk, Dv]`` (float32).
    """

    def __init__(self, sizes: DeltaNetSizes) -> None:
        super().__init__()
        hidden_size, conv_kernel = sizes.hidden_size, sizes.conv_kernel
        num_k_heads, num_v_heads = sizes.num_k_heads, sizes.num_v_heads
        head_k_dim, head_v_dim = sizes.head_k_dim, sizes.head_v_dim
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.eps = sizes.eps
        self.gate_activation = "silu"  # of the output gate; families with another one set it
        self.in_proj = new_param(self.conv_dim + self.value_dim + 2 * num_v_heads, hidden_size)
        self.conv_weight = new_param(self.conv_dim, conv_kernel)
        self.dt_bias = new_param(num_v_heads)
        self.A_log = new_param(num_v_heads)
        self.norm_weight = new_param(head_v_dim)
        self.out_proj = new_param(hidden_size, self.value_dim)
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = packed_targets(
            self.in_proj,
            prefix,
            [
                ("in_proj_qkv.weight", self.conv_dim),
                ("in_proj_z.weight", self.value_dim),
                ("in_proj_b.weight", self.num_v_heads),
                ("in_proj_a.weight", self.num_v_heads),
            ],
        )
        targets.update(
            {
                f"{prefix}conv1d.weight": WeightTarget(self.conv_weight),
                f"{prefix}dt_bias": WeightTarget(self.dt_bias),
                f"{prefix}A_log": WeightTarget(self.A_log),
                f"{prefix}norm.weight": WeightTarget(self.norm_weight),
                f"{prefix}out_proj.weight": WeightTarget(self.out_proj),
            }
        )
        return targets

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4

    def state_shapes(self, num_slots: int, dtype: torch.dtype) -> StateShapes:
        """The conv window in the activations' dtype, the recurrent state in float32
        (``layers.slot_state.SlotStates`` stacks them across layers)."""
        return {
            "conv_state": ((num_slots, self.conv_dim, self.conv_kernel - 1), dtype),
            "recurrent_state": ((num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        }

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_projected(linear(x, self.in_proj), batch)

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on ``norm(x + residual)``, and the stream after the add: the norm runs with
        ``in_proj`` (``layers.normed_linear``), and in a decode-only step where that is one launch,
        the conv step too (``FUSED_CONV``)."""
        if FUSED_CONV and not batch.has_prefill and self.conv_state is not None and fuses(norm, x, self.in_proj):
            projected, conv, summed = kernels.add_rms_norm_gemv_conv(
                x, residual, norm.weight, norm.eps, norm.zero_centered, self.in_proj,
                self.conv_weight, self.conv_state, batch.state_slots[: batch.num_decodes],
            )
            return self.forward_projected(projected, batch, conv), summed
        mixer_in = normed_linear(norm, x, residual, self.in_proj)
        return self.forward_projected(mixer_in.out, batch), mixer_in.residual

    def forward_projected(
        self, projected: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer after ``in_proj``, from its output ``[T, in_proj rows]``; ``conv``: the decode
        step's conv output where the projection's launch ran it (``forward_normed``)."""
        num_tokens = projected.shape[0]
        mixed_qkv, z, b, a = projected.split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        nd = batch.num_decodes
        z = z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        if not batch.has_prefill and FUSED_DECODE_NORM and num_tokens <= DECODE_NORM_MAX_ROWS:
            out = self._decode(mixed_qkv, a, b, batch.state_slots[:nd], conv, z)
            return linear(out.reshape(num_tokens, self.value_dim), self.out_proj)
        if not batch.has_prefill:  # decode only: the step's output is the core
            core = self._decode(mixed_qkv, a, b, batch.state_slots[:nd], conv)
        elif not nd:  # prefill only: no copy into a shared buffer (67 MB a layer at 8k tokens)
            _, cu_seqlens, slots = batch.prefill_part()
            core = self._prefill(mixed_qkv, a, b, slots, cu_seqlens, batch.prefill_snapshots())
        else:
            core = projected.new_empty(num_tokens, self.num_v_heads, self.head_v_dim)
            core[:nd] = self._decode(mixed_qkv[:nd], a[:nd], b[:nd], batch.state_slots[:nd])
            first, cu_seqlens, slots = batch.prefill_part()
            core[first:] = self._prefill(mixed_qkv[first:], a[first:], b[first:], slots, cu_seqlens, batch.prefill_snapshots())
        out = self.output_norm(core, z)
        return linear(out.reshape(num_tokens, self.value_dim), self.out_proj)

    def _decode(
        self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
        conv: torch.Tensor | None = None, z: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per request: the conv step (unless ``conv`` is its output already), then the
        delta-rule step with its gating fused in; with the gate ``z``, the output norm too (its
        output is then out_proj's input)."""
        if conv is None:
            conv = kernels.causal_conv1d_decode(mixed_qkv, self.conv_weight, self.conv_state, slots)
        q, k, v = self._split_heads(conv)
        if z is not None:
            return kernels.gated_delta_rule_decode_gated_norm(
                q, k, v, a, b, self.A_log, self.dt_bias, self.recurrent_state, slots,
                z, self.norm_weight, self.eps, self.gate_activation,
            )
        return kernels.gated_delta_rule_decode_gated(
            q, k, v, a, b, self.A_log, self.dt_bias, self.recurrent_state, slots
        )

    def _prefill(
        self,
        mixed_qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        snapshots: PrefillSnapshots | None,
    ) -> torch.Tensor:
        """The prefill chunks: conv over each chunk, gating, the chunked delta rule; with
        ``snapshots``, the conv windows and recurrent states at boundaries inside the chunks go
        into their snapshot slots too."""
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if snapshots is not None:  # before the conv kernel moves the slots' windows on
            self._snapshot_conv_windows(mixed_qkv, slots, snapshots)
        conv = kernels.causal_conv1d_prefill(mixed_qkv, self.conv_weight, self.conv_state, slots, cu_seqlens)
        q, k, v = self._split_heads(conv)
        return kernels.gated_delta_rule_prefill(q, k, v, g, beta, self.recurrent_state, slots, cu_seqlens, snapshots)

    def _snapshot_conv_windows(self, mixed_qkv: torch.Tensor, slots: torch.Tensor, snapshots: PrefillSnapshots) -> None:
        """Each snapshot's conv window: the last ``K - 1`` conv inputs before its boundary, taken
        from the chunk's inputs, and for a boundary fewer than ``K - 1`` rows into its chunk partly
        from the window the request's slot holds before this chunk."""
        n, width = snapshots.window_rows.shape
        rows = mixed_qkv.index_select(0, snapshots.window_rows.flatten()).view(n, width, self.conv_dim)
        windows = rows.transpose(1, 2)  # [N, C, K - 1], oldest first, as the state holds it
        if snapshots.window_from_state is not None:
            held = self.conv_state.index_select(0, slots.index_select(0, snapshots.requests))
            columns = snapshots.window_rows.clamp(max=width - 1)[:, None, :].expand(n, self.conv_dim, width)
            windows = torch.where(snapshots.window_from_state[:, None, :], held.gather(2, columns), windows)
        self.conv_state.index_copy_(0, snapshots.slots, windows.to(self.conv_state.dtype))

    def output_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated output norm ``(w · x̂) · act(z)``, ``act`` the family's ``gate_activation``."""
        return kernels.gated_rms_norm(core, z, self.norm_weight, self.eps, self.gate_activation)

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        n = conv_out.shape[0]
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )
