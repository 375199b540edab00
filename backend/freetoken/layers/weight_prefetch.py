"""Which weights a decode step prefetches into L2 while a latency-bound launch runs (issue 9), and
how the prefetch launches are queued (``kernels.l2_prefetch``).

At batch 1 the Gated DeltaNet step, its output norm and ``out_proj``'s first weight step follow the
input projection; in an attention layer the prologue and the decode attention do. Those launches
leave HBM mostly idle, and the weights read next are known when the step is captured: the mixer's
output projection, the MoE block's router (with the shared-expert gate) and its shared expert.
So right after the input projection's launch the decoder layer queues one prefetch of those
(``after_input``), and the projections then read them from L2. The routed experts are known only
after routing; the gate/up launch prefetches their down rows (``kernels.triton.moe_decode.PREFETCH_DOWN``).

Each site is a switch, off until the H200 says otherwise (``benchmarks/b1_fusions_ab.py --on``).
The launch either sits in the stream's chain of programmatic dependent launches (``CHAINED``: it
waits for the input projection, the delta-rule step waits for it), or runs on a side stream, a
branch of the graph that nothing waits for until the end of the forward (``WeightPrefetch.join``);
which one is better depends on whether a launch's completion waits for its prefetches to land,
which only the GPU can say.
"""

from __future__ import annotations

from typing import Callable

import torch

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS

# The sites (each off: the A/B switches). OUT_PROJ: the mixer's output projection (GDN out_proj,
# attention o_proj); ROUTER: the router + shared-gate weight; SHARED: the shared expert's gate/up
# and down. All three go in one launch, queued right after the mixer's input projection.
OUT_PROJ = False
ROUTER = False
SHARED = False
# True: the launch is queued in the stream's programmatic-dependent-launch chain; False: on a side
# stream (a branch of the graph), joined at the end of the forward.
CHAINED = False
# Decode-only steps of up to this many rows prefetch (where the projections are GEMVs).
MAX_ROWS = NORMED_MAX_ROWS


def weights_after_input(mixer_out: object, gate: object, shared_gate_up: object, shared_down: object) -> list[torch.Tensor]:
    """The dense weights the switched-on sites prefetch after a layer's input projection (NVFP4
    weights are left out)."""
    wanted = [(OUT_PROJ, mixer_out), (ROUTER, gate), (SHARED, shared_gate_up), (SHARED, shared_down)]
    return [w for on, w in wanted if on and isinstance(w, torch.Tensor)]


class WeightPrefetch:
    """Queues the prefetches of one model's forward: in the chain, or on one side stream per device
    that the forward's end joins."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: set[torch.device] = set()

    def hook(self, batch: ForwardBatch, weights: Callable[[], list[torch.Tensor]]) -> Callable[[], None] | None:
        """What a layer calls right after its input projection's launch, or None where nothing is
        prefetched (a prefill, more than ``MAX_ROWS`` rows, every site off)."""
        if batch.has_prefill or batch.num_tokens > MAX_ROWS or not (OUT_PROJ or ROUTER or SHARED):
            return None
        return lambda: self.issue(weights())

    def issue(self, weights: list[torch.Tensor]) -> None:
        """Queue the prefetch of ``weights`` (on CUDA only: elsewhere there is no L2 to fill)."""
        weights = [w for w in weights if w.device.type == "cuda"]
        if not weights:
            return
        if CHAINED:
            kernels.l2_prefetch(*weights, chained=True)
            return
        device = weights[0].device
        stream = self._streams.get(device)
        if stream is None:  # made at the first (eager) forward, before any capture
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            kernels.l2_prefetch(*weights)
        self._pending.add(device)

    def join(self) -> None:
        """The forward's stream waits for the side streams' prefetches (a graph capture needs every
        branch joined); called after the forward's last launch, so nothing waits for them earlier."""
        for device in self._pending:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])
        self._pending.clear()
