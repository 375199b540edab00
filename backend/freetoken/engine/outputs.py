"""Sampled tokens on their way to the host: a pinned copy and an event, read when resolved.

``OutputRing.send`` queues the device->host copy of a step's tokens (and logprobs: the chosen
token's, its rank, the top-k) behind the step
and returns at once; ``StepOutput.result`` waits for that copy only, so the host can schedule and
stage the next step in between. Two pinned buffers alternate: step N+1's copy may land while the
host still reads step N's; a buffer is reused only after its step was resolved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.core import MAX_LOGPROBS, TokenLogprobs
from freetoken.engine.sample import SampledLogprobs


@dataclass
class StepOutput:
    """A launched step's sampled tokens, one per logits row (``None`` rows are not sampled)."""

    _tokens: torch.Tensor  # host [N] int64
    _logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # host SampledLogprobs
    _event: torch.cuda.Event | None
    _sampled_rows: list[int]  # plan sampling row of each logits row, -1 for padding
    _ring: OutputRing | None = None
    _index: int = 0
    _on_resolve: Callable[[], None] | None = None  # host bookkeeping once the step is done (expert cache)

    def result(self) -> tuple[list[int], list[TokenLogprobs] | None]:
        """Token ids and logprobs of the plan's sampling rows, in order (waits for the step); each
        row's top-k holds as many tokens as the step's largest ``logprobs``."""
        if self._event is not None:
            self._event.synchronize()
        if self._on_resolve is not None:
            self._on_resolve()
            self._on_resolve = None
        tokens = self._tokens.tolist()
        logprobs = None
        if self._logprobs is not None:
            chosen, ranks, top_ids, top_values = (t.tolist() for t in self._logprobs)
            logprobs = [TokenLogprobs(lp, rank, list(zip(ids, values)))
                        for lp, rank, ids, values in zip(chosen, ranks, top_ids, top_values)]
        if self._ring is not None:
            self._ring.release(self._index)
            self._ring = None
        keep = [i for i, row in enumerate(self._sampled_rows) if row >= 0]
        if len(keep) != len(tokens):
            tokens = [tokens[i] for i in keep]
            logprobs = [logprobs[i] for i in keep] if logprobs is not None else None
        return tokens, logprobs


class OutputRing:
    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._tokens = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._logprobs = [torch.zeros(max_rows, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._ranks = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._top_ids = [torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._top_values = [torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._busy = [False, False]
        self._next = 0

    def send(self, tokens: torch.Tensor, logprobs: SampledLogprobs | None, sampled_rows: list[int],
             on_resolve: Callable[[], None] | None = None) -> StepOutput:
        index = self._next
        if self._busy[index]:
            raise RuntimeError("more than two steps in flight: resolve a step before launching another")
        self._busy[index] = True
        self._next = 1 - index
        count = tokens.shape[0]
        host_tokens = self._tokens[index][:count]
        host_tokens.copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            k = logprobs.top_ids.shape[1]
            host_logprobs = (self._logprobs[index][:count], self._ranks[index][:count],
                             self._top_ids[index][:count, :k], self._top_values[index][:count, :k])
            for host, device in zip(host_logprobs, (logprobs.chosen, logprobs.ranks, logprobs.top_ids,
                                                    logprobs.top_values)):
                host.copy_(device, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepOutput(host_tokens, host_logprobs, event, sampled_rows, self, index, on_resolve)

    def release(self, index: int) -> None:
        self._busy[index] = False
