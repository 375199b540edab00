"""The backend's request state machine over the real engine, with a stand-in for the Python backend's
``triton_python_backend_utils`` that enforces its rules: nothing touches a sender after its final
flag (on 2.51 that segfaults the server), every request gets exactly one final flag."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from freetoken.serving.backend import TritonBackend
from freetoken.serving.options import BackendOptions, to_parameters

from .conftest import MAX_TOKENS, PROMPTS

FINAL = 1


class FakeSender:
    def __init__(self) -> None:
        self.responses: list = []
        self.cancelled = False
        self.closed = threading.Event()
        self.violations: list[str] = []

    def send(self, response=None, flags=0) -> None:
        if self.closed.is_set():
            self.violations.append("send after the final flag")
        self.responses.append(response)
        if flags == FINAL:
            self.closed.set()

    def is_cancelled(self) -> bool:
        if self.closed.is_set():
            self.violations.append("is_cancelled after the final flag")
        return self.cancelled


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class FakeResponse:
    def __init__(self, output_tensors=(), error=None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class FakeError:
    INTERNAL, INVALID_ARG, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class FakeMetric:
    def __init__(self) -> None:
        self.value, self.observations = 0.0, []

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v

    def observe(self, v):
        self.observations.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, list[FakeMetric]] = {}

    def __init__(self, name, description, kind) -> None:
        self.name = name

    def Metric(self, labels, buckets=None):
        metric = FakeMetric()
        FakeMetricFamily.created.setdefault(self.name, []).append(metric)
        return metric


class FakePbUtils:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    Tensor, InferenceResponse, TritonError, MetricFamily = FakeTensor, FakeResponse, FakeError, FakeMetricFamily

    def __init__(self) -> None:
        self.unloaded: list[str] = []

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)

    def unload_model(self, name: str) -> None:
        self.unloaded.append(name)


class FakeRequest:
    def __init__(self, **values) -> None:
        self.inputs = {}
        for name, value in values.items():
            array = np.array([value.encode()], dtype=np.object_) if isinstance(value, str) else np.array([value])
            self.inputs[name] = FakeTensor(name, array)
        self.sender = FakeSender()

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def parameters(self) -> str:
        return "{}"

    def request_id(self) -> str:
        return ""


def text(sender: FakeSender) -> str:
    return "".join(b"".join(r.outputs["text_output"]).decode() for r in sender.responses if r is not None and r.outputs)


@pytest.fixture
def backend(demo_model):
    pb = FakePbUtils()
    params = to_parameters(_engine(demo_model), BackendOptions(cancel_poll_ms=20, metrics_interval_ms=20))
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    instance = TritonBackend(pb, config, "freetoken", "1")
    instance.pb = pb
    yield instance
    instance.finalize()


def _engine(demo_model):
    from freetoken.config import EngineConfig

    return EngineConfig(model=str(demo_model), dtype="float32", device="cpu", num_pages=256, max_running_requests=8)


def wait_closed(*requests: FakeRequest, timeout: float = 60) -> None:
    for request in requests:
        assert request.sender.closed.wait(timeout), "no final flag"


def test_streams_complete_with_one_final_flag(backend, reference):
    greedy = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})
    requests = [FakeRequest(text_input=p, stream=True, sampling_parameters=greedy) for p in PROMPTS]
    backend.execute(requests)
    wait_closed(*requests)
    for prompt, request in zip(PROMPTS, requests):
        assert text(request.sender) == reference[prompt][0]
        assert request.sender.responses[-1].error is None and not request.sender.violations


def test_invalid_requests_get_an_error_and_the_batch_goes_on(backend):
    good = FakeRequest(text_input="hi", sampling_parameters=json.dumps({"max_tokens": 2}))
    bad = FakeRequest(text_input="hi", sampling_parameters=json.dumps({"top_p": 2}))
    backend.execute([bad, good])
    wait_closed(bad, good)
    assert len(bad.sender.responses) == 1 and bad.sender.responses[0].error.code == "INVALID_ARG"
    assert "top_p" in bad.sender.responses[0].error.message
    assert good.sender.responses[-1].error is None and text(good.sender).startswith("hi")


def test_cancelled_request_is_aborted_and_only_closed(backend):
    request = FakeRequest(text_input="hi", stream=True, sampling_parameters=json.dumps({"max_tokens": 4000, "ignore_eos": True}))
    backend.execute([request])
    deadline = time.monotonic() + 30
    while len(request.sender.responses) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    request.sender.cancelled = True
    wait_closed(request)
    assert request.sender.responses[-1] is None  # the final flag alone
    assert len(request.sender.responses) < 1000 and not request.sender.violations
    stats = backend.runtime.stats()
    assert (stats.pages_used, stats.slots_used, stats.num_running) == (0, 0, 0)
    time.sleep(0.1)
    finished = FakeMetricFamily.created["vllm:request_success_total"]
    assert sum(m.value for m in finished) >= 1


def observations(name: str) -> list[float]:
    return [v for metric in FakeMetricFamily.created[name] for v in metric.observations]


def test_n_samples_close_together_with_per_token_metrics(backend):
    """n = 2: one response with both samples; vllm:time_per_output_token_seconds gets one
    observation per token after each sample's first, the token-count histograms one per sample,
    vllm:request_params_n one per request."""
    tpot, n_before = len(observations("vllm:time_per_output_token_seconds")), len(observations("vllm:request_params_n"))
    request = FakeRequest(text_input="hi", return_num_output_tokens=True,
                          sampling_parameters=json.dumps({"max_tokens": 6, "ignore_eos": True, "n": 2, "seed": 5}))
    backend.execute([request])
    wait_closed(request)
    (response,) = request.sender.responses
    assert response.outputs["text_output"].shape == (2,) and response.outputs["num_output_tokens"].tolist() == [6, 6]
    deadline = time.monotonic() + 5
    while len(observations("vllm:request_params_n")) == n_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert observations("vllm:request_params_n")[n_before:] == [2]
    assert len(observations("vllm:time_per_output_token_seconds")) - tpot == 2 * 5
    assert observations("vllm:request_generation_tokens")[-2:] == [6, 6]


@pytest.mark.parametrize("stream", [True, False])
def test_num_cached_tokens_are_the_engine_outputs(backend, monkeypatch, stream):
    """Each response's num_cached_tokens is its sample's newest RequestOutput's; a prompt sent
    twice in a row (a prefix-cache hit once the cache exists) included."""
    newest: dict[str, int] = {}
    submit = backend.runtime.submit

    def recording_submit(request, callback):
        def record(output):
            newest[output.request_id] = output.num_cached_tokens
            callback(output)
        submit(request, record)

    monkeypatch.setattr(backend.runtime, "submit", recording_submit)
    params = json.dumps({"temperature": 0, "max_tokens": 4, "ignore_eos": True, "n": 2})
    prompt = " ".join(PROMPTS)  # several KV pages
    for _ in range(2):
        request = FakeRequest(text_input=prompt, stream=stream, return_num_cached_tokens=True, sampling_parameters=params)
        backend.execute([request])
        wait_closed(request)
        sent = [r.outputs["num_cached_tokens"].tolist() for r in request.sender.responses if r is not None and r.outputs]
        assert sent and all(len(values) == 2 for values in sent)
        assert sent[-1] == [newest[i] for i in sorted(newest)]  # the sample ids end in #0, #1
        newest.clear()


def test_cancelled_n_samples_are_all_aborted(backend):
    request = FakeRequest(text_input="hi", stream=True,
                          sampling_parameters=json.dumps({"max_tokens": 4000, "ignore_eos": True, "n": 3}))
    backend.execute([request])
    deadline = time.monotonic() + 30
    while len(request.sender.responses) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.sender.responses[0].outputs["text_output"].shape == (3,)
    request.sender.cancelled = True
    wait_closed(request)
    assert request.sender.responses[-1] is None and not request.sender.violations
    stats = backend.runtime.stats()
    assert (stats.pages_used, stats.slots_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)


def test_engine_death_fails_open_requests_and_unloads(backend):
    scheduler = backend.runtime.scheduler
    open_request = FakeRequest(text_input="hi", stream=True,
                               sampling_parameters=json.dumps({"max_tokens": 4000, "ignore_eos": True}))
    backend.execute([open_request])
    while not open_request.sender.responses:
        time.sleep(0.01)

    def die():
        raise RuntimeError("injected engine failure")

    scheduler.schedule = die
    wait_closed(open_request)
    assert open_request.sender.responses[-1].error is not None and not open_request.sender.violations
    later = FakeRequest(text_input="hi")
    backend.execute([later])
    assert later.sender.responses[-1].error.code == "UNAVAILABLE"
    deadline = time.monotonic() + 5
    while not backend.pb.unloaded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.pb.unloaded == ["freetoken"]


def test_finalize_closes_open_requests_without_unloading(demo_model):
    pb = FakePbUtils()
    params = to_parameters(_engine(demo_model), BackendOptions(cancel_poll_ms=20))
    backend = TritonBackend(pb, {"parameters": {k: {"string_value": v} for k, v in params.items()}}, "freetoken", "1")
    request = FakeRequest(text_input="hi", stream=True, sampling_parameters=json.dumps({"max_tokens": 4000, "ignore_eos": True}))
    backend.execute([request])
    while not request.sender.responses:
        time.sleep(0.01)
    backend.finalize()
    assert request.sender.closed.is_set() and request.sender.responses[-1].error is not None
    assert not request.sender.violations
    time.sleep(0.1)
    assert pb.unloaded == []


def test_execute_returns_in_milliseconds_whatever_the_prompt(backend):
    """Tokenizing happens on a tokenizer thread: a prompt at the byte limit (~1 s to tokenize here)
    does not hold execute(), nor a short request sent right after it."""
    big = FakeRequest(text_input=("The quick brown fox jumps over the lazy dog. " * 5000)[: backend.prompt_byte_limit])
    small = FakeRequest(text_input="hi", sampling_parameters=json.dumps({"max_tokens": 2}))
    for request in (big, small):
        started = time.monotonic()
        backend.execute([request])
        assert time.monotonic() - started < 0.25  # milliseconds when the machine is idle
    wait_closed(small)
    assert not big.sender.closed.is_set()  # the short one was answered while the long one tokenized
    wait_closed(big)
    assert big.sender.responses[-1].error.code == "INVALID_ARG" and "prompt has" in big.sender.responses[-1].error.message
    assert small.sender.responses[-1].error is None


def test_stop_deadline_refuses_new_requests_then_aborts_open_ones(demo_model, tmp_path, monkeypatch):
    from freetoken.serving import control

    monkeypatch.setenv(control.ENV, str(tmp_path))
    pb = FakePbUtils()
    params = to_parameters(_engine(demo_model), BackendOptions(cancel_poll_ms=20))
    backend = TritonBackend(pb, {"parameters": {k: {"string_value": v} for k, v in params.items()}}, "freetoken", "1")
    try:
        assert control.LauncherControl(tmp_path).instance_pids() == [os.getpid()]
        running = FakeRequest(text_input="hi", stream=True,
                              sampling_parameters=json.dumps({"max_tokens": 4000, "ignore_eos": True}))
        backend.execute([running])
        while not running.sender.responses:
            time.sleep(0.01)
        control.LauncherControl(tmp_path).request_stop(0.5)
        time.sleep(0.3)
        late = FakeRequest(text_input="hi")
        backend.execute([late])
        assert late.sender.responses[-1].error.code == "UNAVAILABLE"
        assert "shutting down" in late.sender.responses[-1].error.message
        assert not running.sender.closed.is_set()  # still within the drain
        wait_closed(running, timeout=5)
        error = running.sender.responses[-1].error
        assert error.code == "UNAVAILABLE" and "aborted at the stop timeout" in error.message
        assert not running.sender.violations
        deadline = time.monotonic() + 5
        while backend.runtime.stats().pages_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.runtime.stats().pages_used == 0
    finally:
        backend.finalize()
    assert control.LauncherControl(tmp_path).instance_pids() == []  # finalize deregisters
    assert control.LauncherControl(tmp_path).fatal() is None


def test_request_cancelled_while_tokenizing_is_aborted(backend):
    make_requests = backend.runtime.make_requests

    def slow_make_requests(*args):  # a long tokenization: the cancel poll (20 ms) sees it first
        time.sleep(0.3)
        return make_requests(*args)

    backend.runtime.make_requests = slow_make_requests
    request = FakeRequest(text_input="hi", stream=True,
                          sampling_parameters=json.dumps({"max_tokens": 2000, "ignore_eos": True}))
    request.sender.cancelled = True
    backend.execute([request])
    wait_closed(request, timeout=5)  # aborted: its 2,000 tokens would take far longer
    assert request.sender.responses == [None] and not request.sender.violations
    deadline = time.monotonic() + 5
    while backend.runtime.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.runtime.stats().pages_used == 0
