"""Sampled tokens on their way to the host: a pinned copy and an event, read when resolved.

``OutputRing.send`` queues the device->host copy of a step's tokens (and logprobs) behind the step
and returns at once; ``StepOutput.result`` waits for that copy only, so the host can schedule and
stage the next step in between. Two pinned buffers alternate: step N+1's copy may land while the
host still reads step N's; a buffer is reused only after its step was resolved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepOutput:
    """A launched step's sampled tokens, one per logits row (``None`` rows are not sampled)."""

    _tokens: torch.Tensor  # host [N] int64
    _logprobs: torch.Tensor | None  # host [N] float32
    _event: torch.cuda.Event | None
    _sampled_rows: list[int]  # plan sampling row of each logits row, -1 for padding
    _ring: OutputRing | None = None
    _index: int = 0

    def result(self) -> tuple[list[int], list[float] | None]:
        """Token ids and logprobs of the plan's sampling rows, in order (waits for the step)."""
        if self._event is not None:
            self._event.synchronize()
        tokens = self._tokens.tolist()
        logprobs = self._logprobs.tolist() if self._logprobs is not None else None
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
        self._busy = [False, False]
        self._next = 0

    def send(self, tokens: torch.Tensor, logprobs: torch.Tensor | None, sampled_rows: list[int]) -> StepOutput:
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
            host_logprobs = self._logprobs[index][:count]
            host_logprobs.copy_(logprobs, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepOutput(host_tokens, host_logprobs, event, sampled_rows, self, index)

    def release(self, index: int) -> None:
        self._busy[index] = False
