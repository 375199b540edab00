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

If the engine thread dies, every open request gets an error, new ones get UNAVAILABLE, and the
model asks Triton to unload it, so its readiness turns false.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

from freetoken.runtime import Runtime
from freetoken.serving.metrics import Metrics
from freetoken.serving.options import BackendOptions, options_from_model_config
from freetoken.serving.protocol import ProtocolError, parse_request
from freetoken.serving.responses import ResponseWorker, Sample, Stream, error_response

logger = logging.getLogger(__name__)


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

        def get_input(name: str) -> Any:
            tensor = self._pb.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        spec = parse_request(get_input, request.parameters())
        n = next(self._ids)
        engine_id = f"{n}:{request.request_id()}"
        try:
            engine_requests = self.runtime.make_requests(engine_id, spec.prompt, spec.params)
        except ValueError as exc:  # the prompt: too long for the context, token ids out of the vocabulary
            raise ProtocolError(f"{'text_input' if isinstance(spec.prompt, str) else 'input_ids'}: {exc}") from None
        tokenizer, prompt = self.runtime.tokenizer, spec.prompt
        prompt_text = (lambda: prompt) if isinstance(prompt, str) else functools.partial(tokenizer.decode, prompt)
        worker = self._workers[n % len(self._workers)]
        samples = [Sample(r.request_id) for r in engine_requests]
        worker.adopt(Stream(engine_id, spec, request.get_response_sender(), prompt_text, samples))
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
        try:
            self._pb.unload_model(self.model_name)
        except Exception as exc:
            logger.error("could not unload model %s (is model control explicit?): %s", self.model_name, exc)

    def finalize(self) -> None:
        self.runtime.shutdown()  # fails what is still queued or running; callbacks queue those errors
        for worker in self._workers:
            worker.stop(timeout=10)
        self.metrics.close()


class _Unavailable(Exception):
    pass
