"""Expert stores: where one MoE layer's routed experts live and how they run for routed ids.

``SparseMoE`` routes, then asks its store in two calls: ``prepare(topk_ids)`` (an offloaded store
queues the copies of the experts it misses) and, after the shared expert was queued (it overlaps
those copies), ``compute(x, topk_weights, routing)``. A decode forward of an offloaded store
(``decodes``) instead runs the whole block after the router GEMM as one zero-copy kernel
(``decode``; ``experts.offload``).

- ``ResidentExperts``: the fused ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` on the device.
- ``OffloadedExperts``: the same tensors in host memory; they run from the device cache of
  ``experts.offload``, with ``topk_ids`` mapped to slots. NVFP4 experts are kept as one byte span
  an expert (``experts.span``: the six parts views of one ``[E, span]``), so an expert crosses PCIe
  as one copy. A layer routed to more experts than the
  cache holds runs in passes: bring a group in, run the (token, expert) pairs of that group, add
  them up, next group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.experts.offload import ExpertOffload, distinct_experts, offload_being_built
from freetoken.experts.span import SpanLayout
from freetoken.layers.linear import NVFP4Weight, Weight, experts
from freetoken.layers.weights import new_param


class ResidentExperts(nn.Module):
    def __init__(self, num_experts: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w13: Weight = new_param(num_experts, 2 * intermediate, hidden)
        self.w2: Weight = new_param(num_experts, hidden, intermediate)

    def prepare(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        return experts(x, self.w13, self.w2, topk_weights, routing)


@dataclass
class _Passes:
    topk_ids: torch.Tensor
    groups: list[list[int]]  # the routed experts, per pass; the first one is being copied in
    routed: dict[int, int]  # expert -> tokens routed to it (``distinct_experts``)


def _host_param(*shape: int, pin: bool) -> nn.Parameter:
    """In the build's default dtype, in host memory whatever the build's device."""
    return nn.Parameter(torch.empty(*shape, device="cpu", pin_memory=pin), requires_grad=False)


def _parts(weight: Weight) -> list[torch.Tensor]:
    if isinstance(weight, NVFP4Weight):
        return [weight.packed, weight.scales, weight.row_scales]
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"moe_offload: experts stored as {type(weight).__name__} cannot be offloaded")
    return [weight]


class OffloadedExperts(nn.Module):
    def __init__(self, num_experts: int, intermediate: int, hidden: int, top_k: int, offload: ExpertOffload) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.w13: Weight = _host_param(num_experts, 2 * intermediate, hidden, pin=offload.pin)
        self.w2: Weight = _host_param(num_experts, hidden, intermediate, pin=offload.pin)
        self.offload = offload  # not a module: shared by every layer
        self.span: torch.Tensor | None = None  # NVFP4: the [E, span] the parts are views of (``place_span``)
        self.layer = offload.register(self)
        self.router: Callable[[torch.Tensor], torch.Tensor] | None = None  # x -> topk ids, set by the MoE block
        # The MoE block's shared expert (gate_up, down), set by the block: the decode kernel runs it too.
        self.shared: Callable[[], tuple[Weight, Weight]] | None = None

    def route(self, x: torch.Tensor) -> torch.Tensor:
        assert self.router is not None, "streaming ahead needs the MoE block's router (SparseMoE sets it)"
        return self.router(x)

    def host_parts(self) -> list[torch.Tensor]:
        return _parts(self.w13) + _parts(self.w2)

    def host_span(self) -> torch.Tensor | None:
        return self.span

    def place_span(self) -> None:
        """NVFP4 experts: move the six parts into one uint8 ``[E, span]`` in host memory (page-locked
        with the offload's ``pin``), each part a view of it (``experts.span``), values kept. The NVFP4
        loader calls it once it made both packed weights, before it fills them: the checkpoint's
        tensors are then copied straight into the span, and only this layer's parts exist twice,
        while it runs. Dense experts stay as they are."""
        if self.is_nvfp4():
            self._move_to_span(self.offload.pin)

    def pin_host(self) -> None:
        if self.span is not None:
            if not self.span.is_pinned():
                self._move_to_span(pin=True)  # a new span: ``pin_memory()`` would leave the views behind
            return
        for p in self.host_parts():
            if not p.is_pinned():
                p.data = p.data.pin_memory()

    def _move_to_span(self, pin: bool) -> None:
        """The parts' values into a new span buffer, each part (a parameter, which the loader's
        targets hold) rebound to its view of it."""
        parts = self.host_parts()
        layout = SpanLayout.of(parts)
        span = layout.empty(self.num_experts, "cpu", pin=pin)
        for part, view in zip(parts, layout.views(span)):
            view.copy_(part)
            part.data = view
        self.span = span

    def is_nvfp4(self) -> bool:
        return isinstance(self.w13, NVFP4Weight) and isinstance(self.w2, NVFP4Weight)

    def zero_copy_ready(self) -> bool:
        """The zero-copy decode kernel can run this layer: routed and shared experts both dense, or
        both NVFP4 (``kernels.moe_decode_offload``)."""
        assert self.shared is not None, "the MoE block sets its shared expert"
        weights = (self.w13, self.w2, *self.shared())
        return all(isinstance(w, torch.Tensor) for w in weights) or all(isinstance(w, NVFP4Weight) for w in weights)

    def decodes(self, num_tokens: int) -> bool:
        return self.offload.decodes(num_tokens)

    def decode(self, x: torch.Tensor, gate_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """The MoE block after its router GEMM for a decode forward (``decodes``): every routed
        expert from its cache slot or from pinned host memory; the routed ids go to the offload's
        log (``experts.decode_log``). No host sync."""
        slots = self.offload.slots
        assert slots is not None and self.shared is not None
        shared_gate_up, shared_down = self.shared()
        slot_map, routed = slots.slot_map[self.layer], self.offload.routed_out(self.layer, x.shape[0])
        fills, lend = self.offload.fill_args(self.layer, x.shape[0])
        if self.offload.nvfp4:
            assert isinstance(shared_gate_up, NVFP4Weight) and isinstance(shared_down, NVFP4Weight)
            return kernels.sparse_moe_decode_offload_nvfp4(
                x, gate_logits, slot_map, *slots.tensors, *self.host_parts(), *_parts(shared_gate_up),
                *_parts(shared_down), top_k, renormalize, routed, fills=fills, lend=lend,
            )
        assert isinstance(shared_gate_up, torch.Tensor) and isinstance(shared_down, torch.Tensor)
        return kernels.sparse_moe_decode_offload(
            x, gate_logits, slot_map, slots.tensors[0], slots.tensors[1], self.w13, self.w2,
            shared_gate_up, shared_down, top_k, renormalize, routed, fills=fills, lend=lend,
        )

    def prepare(self, x: torch.Tensor, topk_ids: torch.Tensor) -> _Passes:
        # The routed experts go to the host (one sync), with those the next layer's router picks
        # for ``x`` when the forward streams: which experts to copy is decided there. Then, before
        # anything is launched, every copy the host now knows of is queued: this layer's misses
        # (``begin``), behind them the next layer's predicted experts (``stream_ahead``), so the
        # copy stream never drains while the host launches this layer. Both copy batches wait for
        # the compute stream as of this sync, which has run (a copy queued after the experts launch
        # would wait for that kernel, which reads none of its slots: the copy stream sat idle
        # while the layer's experts ran). The layer's launch itself waits for its own copies
        # anyway, so queuing the stream first costs it nothing while the copies are the longer
        # part. The rest of the bookkeeping (``after_launch``) runs once the launch is queued.
        # With a stream depth D > 1, the D - 1 layers after the next one are predicted from ``x``
        # too and queued behind it, nearest first (``ExpertOffload.stream_ahead``).
        ahead = self.offload.ahead(self.layer) if self.offload.streams(x.shape[0]) else range(0)
        ids = [topk_ids] + [self.offload.layers[layer].route(x) for layer in ahead]
        routed, *predicted = distinct_experts(ids, self.num_experts)
        self.offload.mark_routed(self.layer)
        groups = self.offload.begin(self.layer, list(routed))
        if predicted and len(groups) == 1:  # a layer in passes leaves no slot to spare
            self.offload.stream_ahead(self.layer + 1, [list(p) for p in predicted], groups[0])
        passes = _Passes(topk_ids, groups, routed)
        if len(groups) > 1:  # later passes admit experts: they see this layer passed, as they always did
            self.after_launch(passes)
        return passes

    def after_launch(self, routing: _Passes) -> None:
        """The bookkeeping of ``prepare`` the layer's launch does not need: this layer passed (after
        the stream's evictions, which so never skip this layer's running experts). Once a layer:
        ``compute`` runs it after the one launch, ``prepare`` before the passes."""
        self.offload.passed(self.layer, routing.routed)

    def compute(self, x: torch.Tensor, topk_weights: torch.Tensor, routing: _Passes) -> torch.Tensor:
        slots = self.offload.slots
        assert slots is not None
        if len(routing.groups) == 1:
            slots.wait(self.layer)
            out = self._run(x, topk_weights, routing.topk_ids)
            self.offload.mark_computed(self.layer)
            self.after_launch(routing)
            return out
        out = torch.zeros_like(x)
        flat_ids, flat_weights = routing.topk_ids.flatten(), topk_weights.flatten()
        top_k = routing.topk_ids.shape[1]
        for index, group in enumerate(routing.groups):
            if index:
                self.offload.bring_in(self.layer, group)
            slots.wait(self.layer)
            members = torch.tensor(group, dtype=flat_ids.dtype).to(x.device)
            pairs = torch.isin(flat_ids, members).nonzero().squeeze(1)
            tokens = pairs // top_k
            part = self._run(x[tokens], flat_weights[pairs, None], flat_ids[pairs, None])
            out.index_add_(0, tokens, part)
        self.offload.mark_computed(self.layer)
        return out

    def _run(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts (all cached) for pairs routed only to them, read in their slots
        through the layer's row of the slot map (``expert_slots``): the grouped-GEMM kernels
        compile and pick their tuned tiles per expert count, and see the layer's ``E`` experts, as
        a resident layer, whatever the cache's size."""
        slots = self.offload.slots
        assert slots is not None
        slot_map = slots.slot_map[self.layer]
        if self.offload.nvfp4:
            return kernels.fused_experts_nvfp4(x, *slots.tensors, weights, expert_ids, expert_slots=slot_map)
        return kernels.fused_experts(x, slots.tensors[0], slots.tensors[1], weights, expert_ids, expert_slots=slot_map)


def make_store(num_experts: int, intermediate: int, hidden: int, top_k: int) -> ResidentExperts | OffloadedExperts:
    """The store of a MoE layer being built: offloaded inside ``experts.offload.building(offload)``."""
    offload = offload_being_built()
    if offload is None:
        return ResidentExperts(num_experts, intermediate, hidden)
    return OffloadedExperts(num_experts, intermediate, hidden, top_k, offload)
