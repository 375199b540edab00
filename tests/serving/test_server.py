"""Against the real tritonserver over loopback: gRPC streams, HTTP generate and generate_stream,
exactness against the offline API, validation, cancellation, metrics, load."""

from __future__ import annotations

import http.client
import json
import queue
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from freetoken.bench import loadgen
from freetoken.serving.metrics import FAMILIES

from .conftest import MAX_TOKENS, PROMPTS, Server, sampling

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = sampling(temperature=0.0, max_tokens=MAX_TOKENS)


def grpc_inputs(**values) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in values.items():
        if isinstance(value, str):
            array, datatype = np.array([value.encode()], dtype=np.object_), "BYTES"
        elif isinstance(value, bool):
            array, datatype = np.array([value]), "BOOL"
        else:
            array, datatype = np.array(value, dtype=np.int32), "INT32"
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def grpc_generate(server: Server, timeout: float = 120, **values) -> tuple[list, Exception | None]:
    """One request on its own gRPC stream: (responses, error)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    responses = []
    try:
        client.async_stream_infer(server.model, grpc_inputs(**values), enable_empty_final_response=True)
        while True:
            result, error = events.get(timeout=timeout)
            if error is not None:
                return responses, error
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return responses, None
    finally:
        client.stop_stream()
        client.close()


def text_of(response) -> str:
    return b"".join(response.as_numpy("text_output")).decode()


def http_post(server: Server, path: str, body: dict, timeout: float = 120) -> tuple[int, dict | str]:
    # JSON, not urllib's default form encoding: 2.51 segfaults parsing a multi-MB form-encoded body
    request = urllib.request.Request(f"http://{server.http}/v2/models/{server.model}/{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read().decode()
            return response.status, json.loads(raw) if path == "generate" else raw
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def sse_events(raw: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def wait_for(condition, timeout: float = 15.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def pools_idle(server: Server) -> bool:
    return (server.metric("vllm:kv_cache_usage_perc") == 0 and server.metric("freetoken_state_slots_used") == 0
            and server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:num_requests_waiting") == 0)


# ----- exactness -----


def test_concurrent_grpc_streams_equal_offline_greedy(server, reference):
    def stream(prompt):
        return grpc_generate(server, text_input=prompt, stream=True, sampling_parameters=GREEDY,
                             return_output_ids=True, return_finish_reason=True, return_num_output_tokens=True)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(stream, PROMPTS))
    for prompt, (responses, error) in zip(PROMPTS, results):
        assert error is None, error
        text, ids = reference[prompt]
        assert "".join(text_of(r) for r in responses) == text
        assert [int(t) for r in responses for t in r.as_numpy("output_ids")] == ids
        assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses) == len(ids)
        reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
        assert reasons[:-1] == ["None"] * (len(reasons) - 1) and reasons[-1] in ("stop", "length")


def test_concurrent_http_generate_equals_offline_greedy(server, reference):
    def generate(prompt):
        return http_post(server, "generate", {"text_input": prompt, "sampling_parameters": GREEDY,
                                               "return_num_input_tokens": True, "return_finish_reason": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(generate, PROMPTS))
    for prompt, (status, body) in zip(PROMPTS, results):
        assert status == 200, body
        assert body["text_output"] == prompt + reference[prompt][0]  # the prompt is included by default
        assert body["finish_reason"] in ("stop", "length")
    status, body = http_post(server, "generate", {"text_input": PROMPTS[0], "sampling_parameters": GREEDY,
                                                   "exclude_input_in_output": True})
    assert status == 200 and body["text_output"] == reference[PROMPTS[0]][0]


def test_http_generate_stream_deltas_concatenate_to_offline_text(server, reference):
    prompt = PROMPTS[2]  # multibyte characters
    status, raw = http_post(server, "generate_stream", {"text_input": prompt, "stream": True,
                                                         "sampling_parameters": GREEDY, "return_finish_reason": True})
    assert status == 200
    events = sse_events(raw)
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == reference[prompt][0]
    assert events[-1]["finish_reason"] in ("stop", "length")


def test_input_ids_in_output_ids_out(server, reference):
    from transformers import AutoTokenizer

    from freetoken.demo import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    prompt = PROMPTS[1]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    status, body = http_post(server, "generate", {"input_ids": ids, "sampling_parameters": GREEDY,
                                                   "exclude_input_in_output": True, "return_output_ids": True,
                                                   "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert status == 200, body
    assert body["output_ids"] == reference[prompt][1]
    assert body["text_output"] == reference[prompt][0]
    assert body["num_input_tokens"] == len(ids) and body["num_output_tokens"] == len(reference[prompt][1])


def test_grpc_non_streaming_sends_one_response(server, reference):
    responses, error = grpc_generate(server, text_input=PROMPTS[3],
                                     sampling_parameters=sampling(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0),
                                     return_cumulative_logprob=True, return_logprobs=True, return_output_ids=True)
    assert error is None and len(responses) == 1
    assert text_of(responses[0]) == PROMPTS[3] + reference[PROMPTS[3]][0]
    logprobs = json.loads(responses[0].as_numpy("logprobs")[0])
    assert [int(next(iter(entry))) for entry in logprobs] == reference[PROMPTS[3]][1]
    total = sum(next(iter(entry.values()))["logprob"] for entry in logprobs)
    assert responses[0].as_numpy("cumulative_logprob")[0] == pytest.approx(total, rel=1e-4, abs=1e-4)


# ----- validation -----

BAD_SAMPLING = [
    (sampling(temperature=-1.0), "temperature"),
    (sampling(top_p=1.5), "top_p"),
    (sampling(max_tokens=0), "max_tokens"),
    (sampling(temperature="hot"), "temperature"),
    (sampling(max_tokens=8, best_of=2), "best_of"),
    ('{"max_tokens": 8,', "sampling_parameters"),
    (sampling(stop=[1, 2]), "stop"),
]


@pytest.mark.parametrize("params, field", BAD_SAMPLING, ids=[f for _, f in BAD_SAMPLING])
def test_bad_sampling_parameters_are_refused_and_serving_goes_on(server, reference, params, field):
    status, body = http_post(server, "generate", {"text_input": "hello", "sampling_parameters": params})
    assert status == 400 and field in body["error"], body
    responses, error = grpc_generate(server, text_input="hello", stream=True, sampling_parameters=params)
    assert isinstance(error, InferenceServerException) and field in error.message() and not responses
    status, body = http_post(server, "generate", {"text_input": PROMPTS[0], "sampling_parameters": GREEDY,
                                                   "exclude_input_in_output": True})
    assert status == 200 and body["text_output"] == reference[PROMPTS[0]][0]


@pytest.mark.parametrize("body, field", [
    ({"text_input": ""}, "text_input"),
    ({"text_input": "x", "input_ids": [1, 2]}, "input_ids"),
    ({"input_ids": [1, 10**6]}, "input_ids"),
    ({"input_ids": list(range(1, 300)) * 30}, "input_ids: prompt has 8970 tokens"),
    ({"text_input": "x", "stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
], ids=["empty_prompt", "both_prompts", "token_out_of_vocab", "prompt_too_long", "stream_with_prompt"])
def test_bad_inputs_are_refused(server, body, field):
    status, answer = http_post(server, "generate", body)
    assert status == 400 and field in answer["error"], answer
    status, answer = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=2)})
    assert status == 200


def test_vllm_client_style_string_numbers_are_accepted(server):
    # The vLLM backend's sample client sends {"temperature": "0.1", "top_p": "0.95", ...}.
    params = json.dumps({"temperature": "0", "top_p": "0.95", "max_tokens": "4", "ignore_eos": "true"})
    status, body = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": params,
                                                   "return_num_output_tokens": True})
    assert status == 200 and body["num_output_tokens"] == 4


# ----- cancellation -----


def test_grpc_cancel_aborts_within_a_step_and_frees_pools(server, reference):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(server.model, grpc_inputs(
        text_input=PROMPTS[0], stream=True, sampling_parameters=sampling(max_tokens=4000, ignore_eos=True)))
    for _ in range(3):
        result, error = events.get(timeout=60)
        assert error is None
    assert wait_for(lambda: server.metric("vllm:kv_cache_usage_perc") > 0)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for(lambda: server.metric("vllm:request_success_total", finished_reason="abort") > aborted_before)
    assert wait_for(lambda: pools_idle(server))
    # the vLLM backend's log lines, which its request_cancellation_test.py reads
    assert wait_for(lambda: "[vllm] Successfully cancelled the request" in server.log())
    assert "[vllm] Cancelling the request" in server.log()
    time.sleep(0.3)  # metrics are flushed every 100 ms
    generated = server.metric("vllm:generation_tokens_total")
    time.sleep(0.5)
    assert server.metric("vllm:generation_tokens_total") == generated  # nothing more generated for it
    assert server.metric("vllm:generation_tokens_total") < 1000  # stopped long before max_tokens
    status, body = http_post(server, "generate", {"text_input": PROMPTS[0], "sampling_parameters": GREEDY,
                                                   "exclude_input_in_output": True})
    assert status == 200 and body["text_output"] == reference[PROMPTS[0]][0]


def test_closed_http_stream_is_cancelled(server):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"text_input": PROMPTS[0], "stream": True, "sampling_parameters": sampling(max_tokens=4000, ignore_eos=True)}
    connection.request("POST", f"/v2/models/{server.model}/generate_stream", body=json.dumps(body))
    response = connection.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event
    connection.sock.close()
    connection.close()
    assert wait_for(lambda: server.metric("vllm:request_success_total", finished_reason="abort") > aborted_before)
    assert wait_for(lambda: pools_idle(server))


# ----- metrics and load -----


def test_metrics_families_on_the_metrics_port(server):
    http_post(server, "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=3)})
    text = server.metrics_text()
    for name, (kind, _, _) in FAMILIES.items():
        assert f"# TYPE {name} {kind.lower()}" in text
    assert wait_for(lambda: server.metric("vllm:time_to_first_token_seconds_count") > 0)
    assert server.metric("vllm:prompt_tokens_total") > 0
    assert server.metric("freetoken_kv_cache_pages_total") == 512  # --num-pages 512: usable pages


def test_perf_analyzer_input_data_through_the_load_client(server):
    for name in ("input_data_stream.json", "input_data_generate.json"):
        requests = loadgen.load_input_data(REPO_ROOT / "perf_analyzer_configs" / name)
        summary = loadgen.run(server.grpc, server.model, requests, num_requests=4, concurrency=4, timeout=120)
        assert summary["succeeded"] == 4 and summary["failed"] == 0, summary
        assert summary["output_tokens"] > 0
    assert wait_for(lambda: pools_idle(server))


def test_load_client_shared_prefix_mode(server):
    """Prompts sharing their first 80 of 88 token ids, each asking for num_cached_tokens: one after
    another, every request after the first hits the shared prefix if the server caches prefixes
    (80 is where the first prompt's last full page ends, where a hybrid model's cache snapshots, and
    five pages: at least the scheduler's MIN_SNAPSHOT_GAIN_PAGES)."""
    requests = loadgen.shared_prefix_requests(4, prompt_tokens=88, prefix_tokens=80, max_tokens=4, vocab_size=256)
    assert len({tuple(r["input_ids"][:80]) for r in requests}) == 1
    assert len({tuple(r["input_ids"][80:]) for r in requests}) == 4 and all(len(r["input_ids"]) == 88 for r in requests)
    summary = loadgen.run(server.grpc, server.model, requests, num_requests=4, concurrency=1, timeout=120)
    assert summary["succeeded"] == 4 and summary["output_tokens"] == 16, summary
    caching = "vllm:prefix_cache_hits_total" in server.metrics_text()
    assert summary["num_cached_tokens_mean"] > 0 if caching else summary["num_cached_tokens_mean"] == 0


@pytest.mark.slow
def test_aiperf_run_completes(server, demo_model, tmp_path):
    """perf_analyzer_configs/aiperf.sh as shipped (aiperf on PATH, e.g. from its own venv)."""
    import os
    import shutil
    import subprocess

    if shutil.which("aiperf") is None:
        pytest.skip("aiperf is not installed (pip install aiperf, in a separate environment)")
    shutil.copytree(REPO_ROOT / "perf_analyzer_configs", tmp_path / "perf_analyzer_configs")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HTTP=f"http://{server.http}", MODEL=server.model, TOKENIZER=str(demo_model))
    run = subprocess.run(["bash", "perf_analyzer_configs/aiperf.sh"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    exports = list(tmp_path.glob("artifacts/*/profile_export_aiperf.json"))
    assert exports
    summary = json.loads(exports[0].read_text())
    assert summary["request_count"]["avg"] == 64 and not summary.get("error_request_count")
