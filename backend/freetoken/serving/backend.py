"""The serving layer inside the Python backend stub: requests in, engine, responses out.

Threads and who owns what:

- Triton's thread calls ``execute``: it validates each request, answers the invalid ones at once
  (an error response with the final flag), hands each valid one to a response thread (which owns
  its response sender from then on) and submits it to the engine. It never waits for generation.
- The engine thread runs ``Runtime``; its callback only queues each output for the owning
  response thread (sends block ~0.1-0.2 ms each and must stay off the engine loop).
- Each response thread (``ResponseWorker``, responses.py) owns a share of the requests and is
  the only code that touches their senders: it merges deltas, polls cancellation and closes each
  request exactly once.
- A metrics thread publishes the vllm:* and freetoken_* families (see metrics.py).

- Tokenizer threads tokenize accepted prompts and submit them, so that no prompt, however long,
  holds ``execute`` (and every request queued behind it): prompts up to ``SMALL_PROMPT_BYTES`` on
  one lane, longer ones on another (``LARGE_PROMPT_THREADS``), so that long prompts never queue
  ahead of short ones. A prompt above the byte limit derived from the context is refused before
  tokenizing.
- A control thread watches the launcher's control directory (control.py): on a stop deadline it
  refuses new requests and, once the deadline passes, ends what is still in flight with an error
  naming the shutdown, so Triton's wait for in-flight requests ends before its exit timeout.

If the engine thread dies, every open request gets an error, new ones get UNAVAILABLE, the death is
reported to the launcher, and the model asks Triton to unload it, so its readiness turns false.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from freetoken.core import SamplingParams
from freetoken.runtime import Prompt, Runtime
from freetoken.serving.control import InstanceControl
from freetoken.serving.metrics import Metrics
from freetoken.serving.options import BackendOptions, options_from_model_config
from freetoken.serving.protocol import TEXT_INPUT, GenerateSpec, ProtocolError, parse_request
from freetoken.serving.responses import ResponseWorker, Sample, Stream, error_response

logger = logging.getLogger(__name__)

SMALL_PROMPT_BYTES = 8192  # tokenized in a few ms
LARGE_PROMPT_THREADS = 2
CONTROL_POLL_S = 0.1
SHUTDOWN_MESSAGE = "the server is shutting down"


def prompt_byte_limit(runtime: Runtime) -> int:
    """Bytes beyond which a prompt cannot fit the context, whatever it holds: the context's tokens
    times the longest vocabulary entry (characters, at most 4 UTF-8 bytes each). Refusing above it
    costs no tokenization and never refuses a prompt that would fit."""
    longest = max((len(token) for token in runtime.tokenizer.get_vocab()), default=1)
    return runtime.max_total_tokens * 4 * max(longest, 1)


class TritonBackend:
    """What ``model.py`` delegates to: ``execute`` and ``finalize``."""

    def __init__(self, pb_utils: Any, model_config: dict[str, Any], model_name: str, model_version: str,
                 runtime_factory: Callable[..., Runtime] = Runtime) -> None:
        self._pb = pb_utils
        self.model_name = model_name
        engine_config, options = options_from_model_config(model_config)
        self.options: BackendOptions = options
        self.runtime = runtime_factory(engine_config)
        self.runtime.start()
        self.prompt_byte_limit = prompt_byte_limit(self.runtime)
        labels = {"model": model_name, "version": str(model_version)}
        self.metrics = Metrics(pb_utils if options.report_metrics else None, labels, self.runtime.stats,
                               options.metrics_interval_ms / 1000, self.runtime.engine.max_model_len)
        self._ids = itertools.count()
        self._unloading = threading.Lock()
        self._unload_requested = False
        decode_token = functools.lru_cache(maxsize=1 << 16)(lambda t: self.runtime.tokenizer.decode([t]))
        self._workers = [
            ResponseWorker(f"freetoken-responses-{i}", pb_utils, self.runtime, self.metrics,
                           options.cancel_poll_ms / 1000, self._engine_died, decode_token)
            for i in range(options.response_threads)
        ]
        self._small_prompts = ThreadPoolExecutor(1, thread_name_prefix="freetoken-tokenize-small")
        self._large_prompts = ThreadPoolExecutor(LARGE_PROMPT_THREADS, thread_name_prefix="freetoken-tokenize-large")
        self._stop_deadline: float | None = None  # set by the control thread when the launcher stops the server
        self._closing = threading.Event()
        self.control = InstanceControl(model_name)  # last: a stub-<pid> file means a live, initialized instance
        self._control_thread = threading.Thread(target=self._watch_control, name="freetoken-control", daemon=True)
        self._control_thread.start()
        logger.info("FreeToken engine ready: model %s (%s), %d response threads",
                    self.runtime.model_dir, engine_config.dtype, len(self._workers))

    def execute(self, requests: list[Any]) -> None:
        """Accept or refuse each request; never raises (an exception would fail the whole batch)."""
        for request in requests:
            try:
                self._accept(request)
            except ProtocolError as exc:
                self._refuse(request, str(exc), "INVALID_ARG")
            except _Unavailable as exc:
                self._refuse(request, str(exc), "UNAVAILABLE")
            except Exception as exc:
                logger.exception("accepting a request failed")
                self._refuse(request, f"internal error: {exc}", "INTERNAL")

    def _accept(self, request: Any) -> None:
        if not self.runtime.is_alive:
            self._engine_died()
            raise _Unavailable("the engine thread died; the model is unavailable")
        if self._stop_deadline is not None:
            raise _Unavailable(SHUTDOWN_MESSAGE)

        def get_input(name: str) -> Any:
            tensor = self._pb.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        text = get_input(TEXT_INPUT)
        size = self._check_prompt_bytes(text)
        spec = parse_request(get_input, request.parameters())
        if text is None:
            size = 4 * len(spec.prompt)
        n = next(self._ids)
        engine_id = f"{n}:{request.request_id()}"
        tokenizer, prompt = self.runtime.tokenizer, spec.prompt
        prompt_text = (lambda: prompt) if isinstance(prompt, str) else functools.partial(tokenizer.decode, prompt)
        worker = self._workers[n % len(self._workers)]
        samples = [Sample(sample_id) for sample_id in Runtime.sample_ids(engine_id, spec.params.n)]
        worker.adopt(Stream(engine_id, spec, request.get_response_sender(), prompt_text, samples))
        lane = self._small_prompts if size <= SMALL_PROMPT_BYTES else self._large_prompts
        lane.submit(self._admit, worker, engine_id, spec)

    def _check_prompt_bytes(self, text: np.ndarray | None) -> int:
        """The prompt's size in bytes, refused above the limit (before any decoding or tokenizing)."""
        if text is None:
            return 0
        size = sum(len(item) for item in np.asarray(text, dtype=np.object_).reshape(-1) if isinstance(item, bytes))
        if size > self.prompt_byte_limit:
            raise ProtocolError(
                f"input '{TEXT_INPUT}' has {size} bytes; at most {self.prompt_byte_limit} can fit the "
                f"{self.runtime.max_total_tokens}-token context"
            )
        return size

    def _admit(self, worker: ResponseWorker, engine_id: str, spec: GenerateSpec) -> None:
        """Tokenize and submit (a tokenizer thread); a refusal goes through the stream's owner."""
        try:
            engine_requests = self.runtime.make_requests(engine_id, spec.prompt, spec.params)
            check_context(len(engine_requests[0].prompt_token_ids), spec.params, self.runtime)
        except ProtocolError as exc:
            worker.refuse(engine_id, str(exc), "INVALID_ARG")
        except ValueError as exc:  # the prompt: too long for the context, token ids out of the vocabulary
            worker.refuse(engine_id, f"{input_name(spec.prompt)}: {exc}", "INVALID_ARG")
        except Exception as exc:
            logger.exception("admitting request %s failed", engine_id)
            worker.refuse(engine_id, f"internal error: {exc}", "INTERNAL")
        else:
            for engine_request in engine_requests:
                self.runtime.submit(engine_request, worker.on_output)

    def _refuse(self, request: Any, message: str, code: str) -> None:
        try:
            request.get_response_sender().send(error_response(self._pb, message, code),
                                               flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:
            logger.exception("sending an error response failed")

    def _engine_died(self) -> None:
        """Report the model not ready: ask Triton to unload it (needs --model-control-mode=explicit)."""
        if self.runtime.fatal_error is None:
            return  # stopped, not dead: finalize is under way
        with self._unloading:
            if self._unload_requested:
                return
            self._unload_requested = True
        logger.critical("the engine thread died (%r); unloading model %s", self.runtime.fatal_error, self.model_name)
        self.control.report_death(repr(self.runtime.fatal_error))
        try:
            self._pb.unload_model(self.model_name)
        except Exception as exc:
            logger.error("could not unload model %s (is model control explicit?): %s", self.model_name, exc)

    def _watch_control(self) -> None:
        """Follow the launcher's stop: refuse new requests at once, end the rest at the deadline."""
        while not self._closing.wait(CONTROL_POLL_S):
            deadline = self.control.stop_deadline()
            if deadline is None:
                continue
            if self._stop_deadline is None:
                logger.info("the server is stopping: refusing new requests, %.1f s for those in flight",
                            max(0.0, deadline - time.time()))
                self._stop_deadline = deadline
            if time.time() >= deadline:
                for worker in self._workers:
                    worker.end_all(f"{SHUTDOWN_MESSAGE}: the request was aborted at the stop timeout", "UNAVAILABLE")
                return

    def finalize(self) -> None:
        self._closing.set()
        try:
            for lane in (self._small_prompts, self._large_prompts):
                lane.shutdown(wait=True, cancel_futures=True)
            self.runtime.shutdown()  # fails what is still queued or running; callbacks queue those errors
            for worker in self._workers:
                worker.stop(timeout=10)
            self.metrics.close()
        finally:
            self.control.close()


def input_name(prompt: Prompt) -> str:
    return TEXT_INPUT if isinstance(prompt, str) else "input_ids"


def check_context(num_prompt_tokens: int, params: SamplingParams, runtime: Runtime) -> None:
    """Refuse what cannot finish as asked (as vLLM's servers do) instead of clipping it to ``length``."""
    limit = runtime.max_total_tokens
    if num_prompt_tokens + params.max_tokens > limit:
        raise ProtocolError(
            f"sampling parameter 'max_tokens': the prompt's {num_prompt_tokens} tokens + max_tokens "
            f"{params.max_tokens} = {num_prompt_tokens + params.max_tokens} exceed the {limit}-token context "
            f"(max_model_len {runtime.engine.max_model_len}, KV cache {runtime.scheduler.pages.capacity} pages "
            f"of {runtime.scheduler.pages.page_size} tokens)"
        )


class _Unavailable(Exception):
    pass
