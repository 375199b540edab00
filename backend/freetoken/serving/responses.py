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


def error_response(pb_utils: Any, message: str, code: str) -> Any:
    """An ``InferenceResponse`` carrying a ``TritonError`` of ``code`` ("INVALID_ARG", "UNAVAILABLE", ...)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


class State(enum.Enum):
    OPEN = "open"
    CANCELLED = "cancelled"  # abort asked of the engine; only the final flag goes out from now on
    CLOSED = "closed"


@dataclass(eq=False)
class Stream:
    """One accepted request, owned by one response thread."""

    engine_id: str
    spec: GenerateSpec
    sender: Any  # the request's response sender; None once closed
    prompt_text: Callable[[], str]
    arrival: float = field(default_factory=time.monotonic)
    state: State = State.OPEN
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0


class ResponseWorker:
    """A response thread: the single owner of its streams' senders."""

    def __init__(self, name: str, pb_utils: Any, runtime: Runtime, metrics: Metrics, poll_interval: float,
                 on_engine_death: Callable[[], None]) -> None:
        self._pb = pb_utils
        self._runtime = runtime
        self._metrics = metrics
        self._poll_interval = poll_interval
        self._on_engine_death = on_engine_death
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ----- any thread -----

    def adopt(self, stream: Stream) -> None:
        """Take ownership of a stream; call before submitting it to the engine (ordering)."""
        self._inbox.put(("adopt", stream))

    def on_output(self, output: RequestOutput) -> None:
        """The engine's callback (engine thread): queue, nothing else."""
        self._inbox.put(("output", output, time.monotonic()))

    def refuse(self, engine_id: str, message: str, code: str) -> None:
        """End an adopted stream that was never submitted (its prompt was refused after tokenizing)."""
        self._inbox.put(("refuse", engine_id, message, code))

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
            batches: dict[str, list[tuple[RequestOutput, float]]] = {}
            stopping = False
            for item in items:
                if item[0] == "adopt":
                    self._streams[item[1].engine_id] = item[1]
                elif item[0] == "output":
                    batches.setdefault(item[1].request_id, []).append((item[1], item[2]))
                elif item[0] == "refuse":
                    stream = self._streams.get(item[1])
                    if stream is not None:
                        self._guard(stream, self._end, stream, item[2], item[3], "error")
                elif item[0] == "end_all":
                    for stream in list(self._streams.values()):
                        self._runtime.abort(stream.engine_id)
                        self._guard(stream, self._end, stream, item[1], item[2], "abort")
                else:
                    stopping = True
            for engine_id, batch in batches.items():
                stream = self._streams.get(engine_id)
                if stream is not None:
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
            logger.exception("responding to request %s failed", stream.engine_id)
            if stream.state is State.CLOSED:
                return  # the final flag's own send failed: never touch that sender again
            sender = stream.sender
            self._runtime.abort(stream.engine_id)
            self._forget(stream, "error")
            try:
                sender.send(flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                logger.exception("closing request %s failed", stream.engine_id)

    def _handle(self, stream: Stream, batch: list[tuple[RequestOutput, float]]) -> None:
        outputs = [o for o, _ in batch]
        self._account(stream, batch)
        last = outputs[-1]
        if stream.state is State.CANCELLED:
            if last.finished:
                self._close(stream, None, "abort")
            else:  # cancelled while its prompt was being tokenized: the first abort found nothing
                self._runtime.abort(stream.engine_id)
            return
        if last.finish_reason is FinishReason.ERROR:
            message = last.error or "the engine failed this request"
            self._close(stream, error_response(self._pb, message, "INTERNAL"), "error")
        elif stream.spec.stream:
            response = self._response(stream, outputs)
            if last.finished:
                self._close(stream, response, last.finish_reason.value)
            else:
                stream.sender.send(response)
        elif last.finished:
            self._close(stream, self._response(stream, [last]), last.finish_reason.value)

    def _account(self, stream: Stream, batch: list[tuple[RequestOutput, float]]) -> None:
        new_tokens = 0
        for output, when in batch:
            if output.new_token_ids:
                if stream.first_token_time is None:
                    stream.first_token_time = when
                    m = output.metrics
                    self._metrics.record_first_token(m.get("num_prompt_tokens", 0), m.get("time_to_first_token"),
                                                     m.get("queue_time"))
                stream.last_token_time = when
                new_tokens += len(output.new_token_ids)
        stream.num_tokens += new_tokens
        self._metrics.record_tokens(new_tokens)

    def _response(self, stream: Stream, outputs: list[RequestOutput]) -> Any:
        arrays = build_outputs(stream.spec, outputs, stream.prompt_text)
        return self._pb.InferenceResponse(output_tensors=[self._pb.Tensor(n, a) for n, a in arrays.items()])

    def _close(self, stream: Stream, response: Any, reason: str) -> None:
        """Send the last response (or just the final flag) and let go of the sender, exactly once."""
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

    def _forget(self, stream: Stream, reason: str) -> None:
        stream.state, stream.sender = State.CLOSED, None
        self._streams.pop(stream.engine_id, None)
        inter_token = None
        if stream.num_tokens > 1 and stream.first_token_time is not None and stream.last_token_time is not None:
            inter_token = (stream.last_token_time - stream.first_token_time) / (stream.num_tokens - 1)
        self._metrics.record_finished(reason, time.monotonic() - stream.arrival, inter_token)

    def _poll(self) -> None:
        if self._runtime.fatal_error is not None:  # died (a stopped engine, at finalize, is no failure)
            self._on_engine_death()
            self._fail_open("the engine thread died; the model is unavailable", "UNAVAILABLE")
            return
        for stream in list(self._streams.values()):
            if stream.state is State.OPEN:
                self._guard(stream, self._check_cancelled, stream)

    def _check_cancelled(self, stream: Stream) -> None:
        if stream.sender.is_cancelled():
            logger.info("request %s cancelled by the client", stream.engine_id)
            stream.state = State.CANCELLED
            self._runtime.abort(stream.engine_id)

    def _fail_open(self, message: str, code: str = "UNAVAILABLE") -> None:
        for stream in list(self._streams.values()):
            if stream.state is State.CANCELLED:
                self._guard(stream, self._close, stream, None, "abort")
            else:
                self._guard(stream, self._close, stream, error_response(self._pb, message, code), "error")
