"""The response threads: each owns a share of the requests and is the only code that touches
their response senders.

A ``ResponseWorker`` merges the engine deltas queued for a stream into one response, polls
cancellation every ``cancel_poll_ms`` (``is_cancelled`` is a round trip), and closes each request
exactly once. A closed request's sender is dropped: on 2.51, touching a sender after its final
flag segfaults the server.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from freetoken.core import FinishReason, RequestOutput
from freetoken.runtime import Runtime
from freetoken.serving.metrics import Metrics
from freetoken.serving.protocol import GenerateSpec, build_outputs

logger = logging.getLogger(__name__)

METRICS_SYNC_SECONDS = 0.05  # the most a request's last response waits for its metrics


def error_response(pb_utils: Any, message: str, code: str) -> Any:
    """An ``InferenceResponse`` carrying a ``TritonError`` of ``code`` ("INVALID_ARG", "UNAVAILABLE", ...)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


class State(enum.Enum):
    OPEN = "open"
    CANCELLED = "cancelled"  # abort asked of the engine; only the final flag goes out from now on
    CLOSED = "closed"


@dataclass(eq=False)
class Sample:
    """One of a request's ``n`` samples: an engine request of its own."""

    engine_id: str
    latest: RequestOutput | None = None  # its newest engine output
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    recorded: bool = False  # its end is in the metrics

    @property
    def finished(self) -> bool:
        return self.latest is not None and self.latest.finished


@dataclass(eq=False)
class Stream:
    """One accepted request (its ``n`` samples), owned by one response thread."""

    request_id: str  # for the log
    spec: GenerateSpec
    sender: Any  # the request's response sender; None once closed
    prompt_text: Callable[[], str]
    samples: list[Sample]
    arrival: float = field(default_factory=time.monotonic)
    state: State = State.OPEN
    recorded: bool = False  # vllm:request_params_n has it

    def abort_unfinished(self, runtime: Runtime) -> None:
        for sample in self.samples:
            if not sample.finished:
                runtime.abort(sample.engine_id)


class ResponseWorker:
    """A response thread: the single owner of its streams' senders."""

    def __init__(self, name: str, pb_utils: Any, runtime: Runtime, metrics: Metrics, poll_interval: float,
                 on_engine_death: Callable[[], None], decode_token: Callable[[int], str]) -> None:
        self._pb = pb_utils
        self._runtime = runtime
        self._metrics = metrics
        self._poll_interval = poll_interval
        self._on_engine_death = on_engine_death
        self._decode_token = decode_token
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, tuple[Stream, int]] = {}  # engine id -> (stream, sample index)
        self._requests: dict[str, Stream] = {}  # request id -> stream, while open
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ----- any thread -----

    def adopt(self, stream: Stream) -> None:
        """Take ownership of a stream; call before submitting it to the engine (ordering)."""
        self._inbox.put(("adopt", stream))

    def on_output(self, output: RequestOutput) -> None:
        """The engine's callback (engine thread): queue, nothing else."""
        self._inbox.put(("output", output, time.monotonic()))

    def refuse(self, request_id: str, message: str, code: str) -> None:
        """End an adopted stream that was never submitted (its prompt was refused after tokenizing)."""
        self._inbox.put(("refuse", request_id, message, code))

    def end_all(self, message: str, code: str) -> None:
        """Abort every open stream now, each with an error response carrying ``message`` (shutdown)."""
        self._inbox.put(("end_all", message, code))

    def stop(self, timeout: float) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    # ----- the response thread -----

    def _loop(self) -> None:
        last_poll = time.monotonic()
        while True:
            try:
                items = [self._inbox.get(timeout=self._poll_interval)]
            except queue.Empty:
                items = []
            while True:  # take everything queued, to merge the deltas of busy streams
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            batches: dict[Stream, list[tuple[int, RequestOutput, float]]] = {}
            stopping = False
            for item in items:
                if item[0] == "adopt":
                    self._requests[item[1].request_id] = item[1]
                    for index, sample in enumerate(item[1].samples):
                        self._streams[sample.engine_id] = (item[1], index)
                elif item[0] == "output":
                    owner = self._streams.get(item[1].request_id)
                    if owner is not None:
                        batches.setdefault(owner[0], []).append((owner[1], item[1], item[2]))
                elif item[0] == "refuse":
                    stream = self._requests.get(item[1])
                    if stream is not None:
                        self._guard(stream, self._end, stream, item[2], item[3], "error")
                elif item[0] == "end_all":
                    for stream in self._open_streams():
                        stream.abort_unfinished(self._runtime)
                        self._guard(stream, self._end, stream, item[1], item[2], "abort")
                else:
                    stopping = True
            for stream, batch in batches.items():  # the metrics first: see _sync_metrics
                for index, output, when in batch:
                    self._account(stream, stream.samples[index], output, when)
            self._sync_metrics(batches)
            for stream, batch in batches.items():
                if stream.state is not State.CLOSED:
                    self._guard(stream, self._handle, stream, batch)
            if stopping:
                self._fail_open("the model is being unloaded")
                return
            if time.monotonic() - last_poll >= self._poll_interval:
                last_poll = time.monotonic()
                self._poll()

    def _guard(self, stream: Stream, fn: Callable, *args: Any) -> None:
        """Run ``fn``; if sending fails, abort the request and forget it (its sender is unusable)."""
        try:
            fn(*args)
        except Exception:
            logger.exception("responding to request %s failed", stream.request_id)
            if stream.state is State.CLOSED:
                return  # the final flag's own send failed: never touch that sender again
            sender = stream.sender
            stream.abort_unfinished(self._runtime)
            self._forget(stream, "error")
            try:
                sender.send(flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                logger.exception("closing request %s failed", stream.request_id)

    def _handle(self, stream: Stream, batch: list[tuple[int, RequestOutput, float]]) -> None:
        deltas: list[list[RequestOutput]] = [[] for _ in stream.samples]
        for index, output, _ in batch:
            deltas[index].append(output)
        done = all(sample.finished for sample in stream.samples)
        if stream.state is State.CANCELLED:
            if done:
                self._close(stream, None, "abort")
                logger.info("[vllm] Successfully cancelled the request %s", stream.request_id)
            else:  # cancelled while its prompt was being tokenized: the first abort found nothing
                stream.abort_unfinished(self._runtime)
            return
        failed = next((o for _, o, _ in batch if o.finish_reason is FinishReason.ERROR), None)
        if failed is not None:
            stream.abort_unfinished(self._runtime)
            message = failed.error or "the engine failed this request"
            self._close(stream, error_response(self._pb, message, "INTERNAL"), "error")
        elif stream.spec.stream:
            response = self._response(stream, deltas)
            if done:
                self._close(stream, response)
            else:
                stream.sender.send(response)
        elif done:
            self._close(stream, self._response(stream, deltas))

    def _account(self, stream: Stream, sample: Sample, output: RequestOutput, when: float) -> None:
        """Per-sample timings for the metrics: TTFT at the first token, then one time-per-output-token
        observation per engine output with new tokens (one token per step), as vLLM counts them; the
        sample's end when it finishes, the request's when all its samples have."""
        sample.latest = output
        if output.new_token_ids:
            gaps: list[float] = []
            if sample.first_token_time is None:
                sample.first_token_time = when
                m = output.metrics
                self._metrics.record_first_token(m.get("num_prompt_tokens", 0), m.get("time_to_first_token"),
                                                 m.get("queue_time"))
            else:
                gaps.append(when - sample.last_token_time)
            sample.last_token_time = when
            sample.num_tokens += len(output.new_token_ids)
            self._metrics.record_tokens(len(output.new_token_ids), gaps)
        if output.finished:
            self._record_end(stream, sample, output.finish_reason.value, when)

    def _record_end(self, stream: Stream, sample: Sample, reason: str, when: float) -> None:
        if not sample.recorded:
            sample.recorded = True
            prompt_tokens = len(sample.latest.prompt_token_ids) if sample.latest is not None else 0
            self._metrics.record_finished(reason, when - stream.arrival, prompt_tokens, sample.num_tokens)
        if not stream.recorded and all(s.recorded for s in stream.samples):
            stream.recorded = True
            self._metrics.record_request(len(stream.samples))

    def _sync_metrics(self, batches: dict[Stream, list[tuple[int, RequestOutput, float]]]) -> None:
        """Before a request's last response goes out, let the metrics thread apply its events, so a
        client that reads /metrics right after (as vllm_metrics_test.py does) sees its request."""
        if any(output.finished for batch in batches.values() for _, output, _ in batch):
            self._metrics.sync(METRICS_SYNC_SECONDS)

    def _response(self, stream: Stream, deltas: list[list[RequestOutput]]) -> Any:
        latest = [sample.latest for sample in stream.samples]
        arrays = build_outputs(stream.spec, latest, deltas, stream.prompt_text, self._decode_token)
        return self._pb.InferenceResponse(output_tensors=[self._pb.Tensor(n, a) for n, a in arrays.items()])

    def _close(self, stream: Stream, response: Any, reason: str | None = None) -> None:
        """Send the last response (or just the final flag) and let go of the sender, exactly once.
        ``reason``: how samples that did not finish count in the metrics (abort, error)."""
        sender = stream.sender
        self._forget(stream, reason)
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None:
            sender.send(flags=final)
        else:
            sender.send(response, flags=final)

    def _end(self, stream: Stream, message: str, code: str, reason: str) -> None:
        """Close with an error response, or with only the final flag if the client cancelled."""
        response = error_response(self._pb, message, code) if stream.state is State.OPEN else None
        self._close(stream, response, reason)

    def _forget(self, stream: Stream, reason: str | None) -> None:
        """Let go of a closed stream; samples that never finished count as ``reason`` (abort, error)."""
        stream.state, stream.sender = State.CLOSED, None
        self._requests.pop(stream.request_id, None)
        now = time.monotonic()
        for sample in stream.samples:
            self._streams.pop(sample.engine_id, None)
            self._record_end(stream, sample, reason or "abort", now)

    def _poll(self) -> None:
        if self._runtime.fatal_error is not None:  # died (a stopped engine, at finalize, is no failure)
            self._on_engine_death()
            self._fail_open("the engine thread died; the model is unavailable", "UNAVAILABLE")
            return
        for stream in self._open_streams():
            if stream.state is State.OPEN:
                self._guard(stream, self._check_cancelled, stream)

    def _open_streams(self) -> list[Stream]:
        return list(self._requests.values())

    def _check_cancelled(self, stream: Stream) -> None:
        if stream.sender.is_cancelled():
            # the vLLM backend's log lines, which its CI (request_cancellation_test.py) looks for
            logger.info("[vllm] Cancelling the request %s (cancelled by the client)", stream.request_id)
            stream.state = State.CANCELLED
            stream.abort_unfinished(self._runtime)

    def _fail_open(self, message: str, code: str = "UNAVAILABLE") -> None:
        for stream in self._open_streams():
            if stream.state is State.CANCELLED:
                self._guard(stream, self._close, stream, None, "abort")
            else:
                self._guard(stream, self._close, stream, error_response(self._pb, message, code), "error")
