"""Sparse MoE block with a sigmoid-gated shared expert (Qwen3.5-MoE / Qwen4-Exp ``mlp``)."""

from __future__ import annotations


import torch
from torch import nn

from freetoken import kernels
from freetoken.experts.store import OffloadedExperts, ResidentExperts, make_store
from freetoken.layers.linear import Weight, linear, sparse_moe_decode
from freetoken.layers.norm import RMSNorm
from freetoken.layers.moe_partial import MoEPartial
from freetoken.layers.normed_linear import normed_linear
from freetoken.layers.weights import WeightTarget, new_param, packed_targets

# Up to this many tokens the block after the router GEMM runs as one fused op (``kernels.sparse_moe_decode``):
# three launches instead of eleven. It reads each (token, expert) pair's weights without grouping by
# expert, so past a few tokens the duplicate expert reads (about 11% more expert bytes at 8 tokens
# under uniform routing) outweigh the launches saved and the grouped path runs.
DECODE_MAX_TOKENS = 8
# Past DECODE_MAX_TOKENS, the grouped path hands its output on in parts (``MoEPartial``) when its
# caller asks: the pairs' outputs, unsummed, and the shared expert's, which the next norm sums, adds
# to the residual and normalizes in one launch (``kernels.moe_combine_add_rms_norm``), instead of
# three (``sum_choices``, ``shared_expert_combine``, ``add_rms_norm``). False: the block's output
# is summed here as before (for A/B runs).
COMBINE_IN_NEXT_NORM = True
# Up to this many tokens (and with the routed experts' intermediate size) the shared expert runs as
# more row tiles of the grouped expert GEMMs (``kernels.fused_experts_shared_pairs``), saving its two
# GEMMs and its SiLU launch; past it (prefill) cuBLAS's dense GEMMs are faster than the grouped
# kernel's tiles. 0: never.
SHARED_IN_GROUPED_MAX_TOKENS = 128
# The router + shared-gate weight's rows are a multiple of this (8 rows: 16 bytes of bf16 output a row).
GATE_ROW_ALIGN = 8


class SparseMoE(nn.Module):
    """Router (softmax, top-k, renormalised) -> routed experts; plus ``sigmoid(x·w_g) · shared_expert(x)``.

    Expert weights are kept fused: ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``,
    in the layer's expert store (``experts.store``: resident on the device, or offloaded to host
    memory behind the device expert cache). The router and the shared-expert gate share one GEMM
    (``gate_weight`` holds both).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_intermediate_size: int,
        renormalize: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = moe_intermediate_size
        self.shared_intermediate = shared_intermediate_size
        # Zero rows pad the GEMM's output rows to a multiple of 16 bytes: cuBLAS's aligned kernels
        # (H200, 256 experts: 5.8 us against 8.4 at 16 tokens; benchmarks/moe_route_sweep.py).
        self.gate_weight = new_param(-(-(num_experts + 1) // GATE_ROW_ALIGN) * GATE_ROW_ALIGN, hidden_size)
        self.experts = make_store(num_experts, moe_intermediate_size, hidden_size, top_k)
        if isinstance(self.experts, OffloadedExperts):
            self.experts.router = self._route  # the previous layer streams this one's experts in with it
            self.experts.shared = self._shared_expert  # its zero-copy decode kernel runs the shared expert
        self.shared_gate_up = new_param(2 * shared_intermediate_size, hidden_size)
        self.shared_down = new_param(hidden_size, shared_intermediate_size)
        # A bias on the router logits [E], which no released checkpoint has: benchmarks on random
        # weights set it to route with a real model's expert skew (``bench.routing_trace``).
        self.router_bias: torch.Tensor | None = None

    @property
    def w13(self) -> Weight:
        return self.experts.w13

    @property
    def w2(self) -> Weight:
        return self.experts.w2

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        i = self.intermediate
        targets = packed_targets(
            self.gate_weight,
            prefix,
            [("gate.weight", self.num_experts), ("shared_expert_gate.weight", 1)],
            padding="gate_padding",
        )
        targets.update(
            packed_targets(
                self.shared_gate_up,
                f"{prefix}shared_expert.",
                [("gate_proj.weight", self.shared_intermediate), ("up_proj.weight", self.shared_intermediate)],
            )
        )
        targets[f"{prefix}shared_expert.down_proj.weight"] = WeightTarget(self.shared_down)
        # The fused layout of transformers' in-memory model, and the per-expert layout of released checkpoints.
        targets[f"{prefix}experts.gate_up_proj"] = WeightTarget(self.w13)
        targets[f"{prefix}experts.down_proj"] = WeightTarget(self.w2)
        for e in range(self.num_experts):
            expert = f"{prefix}experts.{e}."
            targets[f"{expert}gate_proj.weight"] = WeightTarget(self.w13, slice(0, i), e)
            targets[f"{expert}up_proj.weight"] = WeightTarget(self.w13, slice(i, 2 * i), e)
            targets[f"{expert}down_proj.weight"] = WeightTarget(self.w2, None, e)
        return targets

    def _shared_expert(self) -> tuple[Weight, Weight]:
        return self.shared_gate_up, self.shared_down

    def _route(self, x: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids of ``x`` (softmax keeps the logits' order)."""
        return torch.topk(self._gate_logits(x)[:, : self.num_experts], self.top_k, dim=-1).indices

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router logits [T, E], then the shared expert's gate logit: one GEMM."""
        return self._finish_gate_logits(linear(x, self.gate_weight))

    def _finish_gate_logits(self, projected: torch.Tensor) -> torch.Tensor:
        """The ``gate_weight`` GEMM's output with its padding columns dropped and the router bias added."""
        gate_logits = projected[:, : self.num_experts + 1]
        if self.router_bias is not None:
            gate_logits[:, : self.num_experts] += self.router_bias
        return gate_logits

    def forward_normed(
        self, norm: RMSNorm, x: torch.Tensor | MoEPartial, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor | MoEPartial, torch.Tensor]:
        """The block on ``norm(x + residual)``, and the stream after the add (``x + residual``): the
        norm runs with the router GEMV (``layers.normed_linear``)."""
        projected = normed_linear(norm, x, residual, self.gate_weight, return_normed=True)
        return self(projected.normed, projected.out, partial=True), projected.residual

    def forward(
        self, x: torch.Tensor, projected: torch.Tensor | None = None, partial: bool = False
    ) -> torch.Tensor | MoEPartial:
        """The block on ``x``; ``projected``: the ``gate_weight`` GEMM of ``x`` where the caller ran it
        already (with the norm that made ``x``: ``layers.normed_linear``). ``partial``: the caller
        takes a ``MoEPartial`` (it adds the residual and normalizes next), which the grouped path of
        dense resident experts returns under ``COMBINE_IN_NEXT_NORM``."""
        if projected is None:
            projected = linear(x, self.gate_weight)
        gate_logits = self._finish_gate_logits(projected)
        if isinstance(self.experts, ResidentExperts) and x.shape[0] <= DECODE_MAX_TOKENS:
            fused = sparse_moe_decode(
                x, gate_logits, self.w13, self.w2, self.shared_gate_up, self.shared_down, self.top_k, self.renormalize
            )
            if fused is not None:
                return fused
        elif isinstance(self.experts, OffloadedExperts) and self.experts.decodes(x.shape[0]):
            return self.experts.decode(x, gate_logits, self.top_k, self.renormalize)
        router_logits, shared_gate = gate_logits[:, : self.num_experts], gate_logits[:, self.num_experts :]
        weights, ids = kernels.moe_topk_softmax(router_logits, self.top_k, self.renormalize)
        if partial and COMBINE_IN_NEXT_NORM and self._dense_resident():
            return self._partial(x, weights, ids, shared_gate)
        routing = self.experts.prepare(x, ids)  # offloaded: the missing experts' copies start
        shared = linear(kernels.silu_and_mul(linear(x, self.shared_gate_up)), self.shared_down)
        routed = self.experts.compute(x, weights, routing)
        return kernels.shared_expert_combine(routed, shared, shared_gate)

    def _dense_resident(self) -> bool:
        weights = (self.w13, self.w2, self.shared_gate_up, self.shared_down)
        return isinstance(self.experts, ResidentExperts) and all(isinstance(w, torch.Tensor) for w in weights)

    def _partial(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared_gate: torch.Tensor
    ) -> MoEPartial:
        if x.shape[0] <= SHARED_IN_GROUPED_MAX_TOKENS and self.shared_intermediate == self.intermediate:
            pairs, shared = kernels.fused_experts_shared_pairs(
                x, self.w13, self.w2, weights, ids, self.shared_gate_up, self.shared_down, shared_gate
            )
            return MoEPartial(pairs, shared, None)
        shared = linear(kernels.silu_and_mul(linear(x, self.shared_gate_up)), self.shared_down)
        return MoEPartial(kernels.fused_experts_pairs(x, self.w13, self.w2, weights, ids), shared, shared_gate)
