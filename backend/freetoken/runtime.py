"""The runtime: engine, scheduler and request table, stepped by the caller (the offline ``LLM``)
or by its own engine thread (the Triton backend).

Thread safety: ``submit`` and ``abort`` may be called from any thread; they only queue work for the
engine thread. Everything else runs on the thread that steps.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import random
import threading
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.config import EngineConfig
from freetoken.core import FinishReason, RequestOutput, SamplingParams
from freetoken.engine.engine import Engine
from freetoken.engine.outputs import StepOutput
from freetoken.output import OutputText, append_token, make_output
from freetoken.scheduler.cache import PagePool, SlotPool
from freetoken.scheduler.prefix_cache import PageHashChain, PrefixCache
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import ScheduledStep, Scheduler
from freetoken.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
Prompt = str | list[int]


@dataclass
class PrefixCacheStats:
    queried_tokens: int  # prompt tokens looked up in the prefix index, since start
    hit_tokens: int  # of those, found cached (their prefill skipped)
    cached_pages: int  # KV pages the index holds now (shared with requests or not)
    snapshot_slots_used: int  # state snapshots held now
    snapshot_slots_total: int


@dataclass
class ExpertCacheStats:
    hits: int  # routed (token-batch, expert) uses found in the device cache, since start
    misses: int  # uses whose expert had to be copied in
    bytes_copied: int  # host -> device expert bytes
    prefetched: int  # experts copied ahead of their layer's routing
    prefetch_hits: int  # of those, used by that layer
    slots: int  # device slots of the cache
    zero_copy_bytes: int = 0  # expert bytes the decode kernels read from host memory (their misses)
    read_through_fills: int = 0  # decode misses written into a slot by the kernel that read them (no copy)
    # Eager forwards (prompt chunks), CUDA only: device seconds the copy stream spent copying experts
    # in, and the compute stream waiting for those copies (the part the prefill stream did not hide).
    eager_copy_seconds: float = 0.0
    eager_copy_wait_seconds: float = 0.0


@dataclass
class RuntimeStats:
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    slots_used: int
    slots_total: int
    num_preemptions: int
    prefix_cache: PrefixCacheStats | None = None  # None: prefix caching off
    expert_cache: ExpertCacheStats | None = None  # None: experts resident


@dataclass(eq=False)
class _Entry:
    """A request's row in the runtime's table: who gets its outputs, and its text."""

    callback: OutputCallback | None
    text: OutputText


def freeze_startup_objects() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``).

    What start-up built (the model's modules and tensors, the tokenizer, the pools and tables)
    lives as long as the process, but a full (generation-2) collection scans every tracked object:
    on the H200 at the Qwen3.6-35B-A3B shape such collections took 37-122 ms each, on the thread that
    launches the steps, and one of them stalled an offloaded 8k prefill's copy stream for 132 ms
    (docs/benchmarks.md, session 21). Frozen objects are never scanned; collections still run for
    what is allocated afterwards, which the steps free again. A process that builds and drops
    engines one after another (tests) calls ``gc.unfreeze()`` after dropping one, or frozen
    reference cycles are never freed.
    """
    gc.collect()
    gc.freeze()


class Runtime:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        model_dir = config.model
        if model_dir is None:
            from freetoken.demo import ensure_demo_model

            model_dir = str(ensure_demo_model())
        self.model_dir = model_dir
        self.engine = Engine(config, model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        sizes = self.engine.pool_sizes
        pages, slots = PagePool(sizes.num_pages, config.page_size), SlotPool(sizes.num_slots)
        prefix_cache = None
        if config.enable_prefix_caching:
            snapshot_slots = range(sizes.num_slots, sizes.num_state_slots)
            prefix_cache = PrefixCache(pages, snapshot_slots, self.engine.model.prefix_alignment(config.page_size))
        self.scheduler = Scheduler(
            pages, slots, config.max_prefill_length, config.max_running_requests, prefix_cache,
            snapshots_in_forward=self.engine.model.snapshots_in_forward,
        )
        self.max_total_tokens = min(self.engine.max_model_len, pages.capacity * pages.page_size)
        self.eos_token_ids = set(self.engine.loaded.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seed_rng = random.Random(config.seed)
        self._table: dict[str, _Entry] = {}  # request id -> entry, from submission until delivered finished
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.fatal_error: BaseException | None = None
        self.overlap = config.overlap_schedule
        self._in_flight: tuple[ScheduledStep, StepOutput] | None = None
        freeze_startup_objects()

    # ----- building requests (any thread) -----

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self._prompt_ids(prompt).tolist()

    def _prompt_ids(self, prompt: Prompt) -> np.ndarray:
        """The prompt's ids as an int64 array; raises ``ValueError`` naming a bad id. Given ids are
        checked over one C array (an 8k-token prompt: no per-token Python work); the loop over
        them runs only to name the first bad one."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return np.array(self.tokenizer.encode(prompt, add_special_tokens=False), dtype=np.int64)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.engine.vocab_size
        try:
            ids = np.frombuffer(array("q", prompt), dtype=np.int64)
        except (TypeError, OverflowError):  # not integers, or beyond int64
            ids = None
        if ids is None or ids.min() < 0 or ids.max() >= vocab:
            for token in prompt:
                if not isinstance(token, int) or not 0 <= token < vocab:
                    raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {token!r}")
        return ids

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """Validate, tokenize, fill in the sampling defaults; raises ``ValueError`` naming what is wrong."""
        if params.n != 1:
            raise ValueError(f"sampling parameter 'n' must be 1 here, got {params.n}: n > 1 is served by "
                             "`freetoken serve`; offline, give the prompt n times")
        return self.make_requests(request_id, prompt, params)[0]

    def make_requests(self, request_id: str, prompt: Prompt, params: SamplingParams) -> list[Request]:
        """``params.n`` sibling requests of one prompt (tokenized once), as vLLM's parallel sampling
        lays them out: sample ``i`` is ``request_id#i`` (``request_id`` alone when n is 1) and, for a
        seeded request, draws from ``seed + i``. With prefix caching, samples after the first are
        admitted once the first computed the prompt, and hit its pages and snapshot: the prompt is
        prefilled once (bar its last page); without, each prefills it on its own.

        With prefix caching the samples share one ``PageHashChain`` of the prompt: each page's hash
        is computed once, when first asked for (the lookup hashes up to the prompt's first miss, the
        rest is hashed when its pages join the index, after the forward is queued)."""
        ids = self._prompt_ids(prompt)
        token_ids = ids.tolist()
        hashes = None
        if self.config.enable_prefix_caching:
            hashes = PageHashChain(ids, self.config.page_size)
        if params.n == 1:
            return [self._make_request(request_id, token_ids, ids, hashes, params)]
        requests = []
        for i, sample_id in enumerate(self.sample_ids(request_id, params.n)):
            seed = None if params.seed is None else params.seed + i
            sample_params = dataclasses.replace(params, n=1, seed=seed)
            requests.append(self._make_request(sample_id, token_ids, ids, hashes, sample_params))
        if self.config.enable_prefix_caching:
            for sibling in requests[1:]:
                sibling.prefill_after = requests[0]
        return requests

    @staticmethod
    def sample_ids(request_id: str, n: int) -> list[str]:
        """The engine ids ``make_requests`` gives the ``n`` samples of ``request_id``."""
        return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

    def _make_request(
        self,
        request_id: str,
        token_ids: list[int],
        ids: np.ndarray,
        hashes: PageHashChain | None,
        params: SamplingParams,
    ) -> Request:
        params.validate()
        if len(token_ids) >= self.max_total_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; at most {self.max_total_tokens - 1} fit "
                f"(max_model_len {self.engine.max_model_len}, KV cache {self.scheduler.pages.capacity} pages)"
            )
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            sampling=params.resolve(self.engine.loaded.generation_config, self._seed_rng),
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=stop_ids,
            max_total_tokens=self.max_total_tokens,
            page_hashes=hashes,
            prompt_array=ids,
        )

    def submit(self, request: Request, callback: OutputCallback | None = None) -> None:
        """Queue a request for the engine thread; ``callback`` gets each output (on that thread)."""
        params = request.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self._inbox.put(("add", (request, _Entry(callback, OutputText(detokenizer)))))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ----- stepping (the engine thread, or the offline caller) -----

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None or not self._inbox.empty()

    def step(self) -> list[RequestOutput]:
        """One turn of the loop: take queued submissions and aborts, launch the next step, then
        resolve a step's tokens (append, stop checks, detokenize, outputs).

        Overlapped (``overlap_schedule``, the default) the step resolved is the previous one: the
        host does that work, and schedules and stages the next step on the following call, while
        the device runs the step just launched. A decode scheduled before its last token reached
        the host reads it from the device's last-token pool. Synchronous, the step launched is
        resolved at once (the same tokens, one step of latency less per output, no overlap).
        """
        outputs = self._drain_inbox()
        launched = self._launch(outputs)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            outputs += self._land(*previous)
        if not self.overlap and self._in_flight is not None:
            outputs += self._land(*self._in_flight)
            self._in_flight = None
        return outputs

    def _launch(self, outputs: list[RequestOutput]) -> tuple[ScheduledStep, StepOutput] | None:
        step = self.scheduler.schedule()
        if step is None:
            return None
        try:
            pending = self.engine.launch(step.plan)
        except Exception as exc:  # a failed step fails its requests; the engine keeps serving
            logger.error("engine step failed:\n%s", traceback.format_exc())
            self.scheduler.failed(step)
            for req in step.requests:
                outputs.append(self._finish(req, FinishReason.ERROR, error=f"engine step failed: {exc}"))
            return None
        self.scheduler.launched(step)
        return step, pending

    def _land(self, step: ScheduledStep, pending: StepOutput) -> list[RequestOutput]:
        """Append a launched step's sampled tokens to their requests; finished ones give their
        pages and slot back (requests aborted or failed meanwhile are skipped)."""
        outputs: list[RequestOutput] = []
        try:
            token_ids, logprobs = pending.result()
        except Exception as exc:
            logger.error("engine step failed:\n%s", traceback.format_exc())
            self.scheduler.landed(step)
            for req in step.requests:
                if not req.finished:
                    outputs.append(self._finish(req, FinishReason.ERROR, error=f"engine step failed: {exc}"))
            return outputs
        self.scheduler.landed(step)
        for index, req in enumerate(step.sampling_requests):
            if req.finished:
                continue
            logprob = None
            if logprobs is not None and req.params.logprobs is not None:  # its own k of the step's top-k
                logprob = dataclasses.replace(logprobs[index], top=logprobs[index].top[: req.params.logprobs])
            text = self._table[req.request_id].text
            append_token(req, text, token_ids[index], logprob)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
            outputs.append(make_output(req, text, [token_ids[index]], [logprob] if logprob is not None else None))
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                request, entry = payload
                if request.request_id in self._table:
                    logger.warning("duplicate request id %s rejected", request.request_id)
                    request.error = f"request id {request.request_id!r} is already in use"
                    request.finish_reason = FinishReason.ERROR
                    if entry.callback is not None:
                        entry.callback(make_output(request, entry.text, [], None))
                    continue
                self._table[request.request_id] = entry
                self.scheduler.add(request)
            elif kind == "abort":
                req = self.scheduler.find(payload)
                if req is not None:
                    outputs.append(self._finish(req, FinishReason.ABORT))
            elif kind == "reset_prefix_cache":
                self.scheduler.reset_prefix_cache()

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        req.finish_reason, req.error = reason, error
        self.scheduler.finish(req)
        return make_output(req, self._table[req.request_id].text, [], None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their callbacks; forget requests that finished."""
        for output in outputs:
            entry = self._table.get(output.request_id)
            if output.finished:
                self._table.pop(output.request_id, None)
            callback = entry.callback if entry is not None else None
            if callback is None:
                continue
            try:
                callback(output)
            except Exception:
                logger.error("output callback of %s failed:\n%s", output.request_id, traceback.format_exc())
                if not output.finished:
                    self.abort(output.request_id)

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position, in pages and a slot borrowed from the pools (the caller's thread)."""
        scheduler = self.scheduler
        pages = scheduler.allocate_pages(scheduler.pages.pages_for(len(token_ids)))
        slot = scheduler.slots.allocate()
        try:
            return self.engine.prompt_logits(token_ids, pages, slot)
        finally:
            scheduler.release_pages(pages)
            scheduler.slots.release(slot)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (vLLM's ``reset_prefix_cache``): pages and snapshots no request
        holds go back to the pools. From another thread while the engine thread runs, it is queued
        for that thread like an abort."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("reset_prefix_cache", None))
            self._wake.set()
        else:
            self.scheduler.reset_prefix_cache()

    def forget(self, request_id: str) -> None:
        self._table.pop(request_id, None)

    # ----- the engine thread -----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.has_work:
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self.deliver(self.step())
            self._fail_all("the server is shutting down")
        except BaseException as exc:  # the loop is dead: fail everything queued, report not ready
            self.fatal_error = exc
            logger.critical("engine thread died:\n%s", traceback.format_exc())
            self._fail_all(f"engine thread died: {exc}")

    def _fail_all(self, message: str) -> None:
        self._drain_inbox()
        if self._in_flight is not None:
            try:
                self._in_flight[1].result()
            except Exception:  # the device failed too; the requests fail below either way
                pass
            self._in_flight = None
        outputs = [
            self._finish(req, FinishReason.ERROR, error=message)
            for req in (*self.scheduler.running, *self.scheduler.waiting)
        ]
        self.deliver(outputs)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def stats(self) -> RuntimeStats:
        """``pages_used`` counts the pages requests hold: cached pages no request holds are as good
        as free (an allocation evicts them), as in vLLM's KV cache usage."""
        scheduler = self.scheduler
        pages, slots, cache = scheduler.pages, scheduler.slots, scheduler.prefix_cache
        prefix = None
        if cache is not None:
            prefix = PrefixCacheStats(
                queried_tokens=cache.counters.queried_tokens,
                hit_tokens=cache.counters.hit_tokens,
                cached_pages=cache.num_cached_pages,
                snapshot_slots_used=cache.num_snapshots,
                snapshot_slots_total=cache.num_snapshot_slots,
            )
        return RuntimeStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            pages_used=pages.capacity - scheduler.num_available_pages,
            pages_total=pages.capacity,
            slots_used=slots.capacity - slots.num_free,
            slots_total=slots.capacity,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache=prefix,
            expert_cache=self._expert_cache_stats(),
        )

    def _expert_cache_stats(self) -> ExpertCacheStats | None:
        cache = self.engine.expert_cache_counters()
        if cache is None:
            return None
        counters, num_slots = cache
        return ExpertCacheStats(counters.hits, counters.misses, counters.bytes_copied, counters.prefetched,
                                counters.prefetch_hits, num_slots, counters.zero_copy_bytes,
                                counters.read_through_fills, counters.eager_copy_seconds,
                                counters.eager_wait_seconds)
