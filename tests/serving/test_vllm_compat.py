"""The vLLM backend's protocol and metrics, point by point, against the real tritonserver: what its
CI client tests (triton-inference-server/vllm_backend, ci/L0_*) check, on the demo model."""

from __future__ import annotations

import json
import random
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from freetoken.serving.metrics import (E2E_BUCKETS, FAMILIES, N_BUCKETS, OWNER_LABEL, PREFIX_CACHE_FAMILIES, TPOT_BUCKETS,
                                      TTFT_BUCKETS)

from .conftest import PROMPTS, Server, sampling
from .test_server import grpc_generate, wait_for

VLLM_PROMPT = "In this example,"


def _as_text(array) -> list[str]:
    return [v.decode() for v in array]


# ----- additional outputs (ci/L0_additional_outputs_vllm) -----


@pytest.mark.parametrize("logprobs", [None, 0, 2])
@pytest.mark.parametrize("stream", [True, False])
def test_additional_outputs_as_the_vllm_backend_sends_them(server, demo_model, stream, logprobs):
    """additional_outputs_test.py's checks. Its last one, that the chosen tokens' decoded_token
    concatenate to text_output, holds for OPT's text only: the demo model's byte-level tokens can
    split a character, so here each decoded_token is the token decoded alone (as vLLM spells it)
    and the chosen ids decode to text_output."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model))
    params = {"temperature": "0", "top_p": "1", "max_tokens": 12, "ignore_eos": True}
    if logprobs is not None:
        params["logprobs"] = logprobs
    responses, error = grpc_generate(server, text_input=VLLM_PROMPT, stream=stream, sampling_parameters=json.dumps(params),
                                     return_finish_reason=True, return_cumulative_logprob=True, return_logprobs=True,
                                     return_num_input_tokens=True, return_num_output_tokens=True,
                                     return_output_ids=True)
    assert error is None and responses
    responses = [r for r in responses if r.as_numpy("text_output") is not None]  # the empty final flag
    assert len(responses) > 1 if stream else len(responses) == 1
    previous_cumulative = 0.0
    for i, response in enumerate(responses):
        reason = _as_text(response.as_numpy("finish_reason"))[0]
        assert reason == ("length" if i == len(responses) - 1 else "None")
        cumulative = float(response.as_numpy("cumulative_logprob")[0])
        assert cumulative != previous_cumulative and cumulative < 0
        previous_cumulative = cumulative
        num_input = int(response.as_numpy("num_input_tokens")[0])
        assert 0 < num_input <= len(VLLM_PROMPT)
        num_output = int(response.as_numpy("num_output_tokens")[0])
        assert num_output > 0
        entries = json.loads(response.as_numpy("logprobs")[0])
        if logprobs is None:
            assert entries is None  # not asked for in sampling_parameters: null
            continue
        assert len(entries) == num_output
        chosen = []
        for entry in entries:
            assert 1 <= len(entry) <= logprobs + 1
            ranks = [d["rank"] for d in entry.values()]
            assert ranks.count(1) == 1  # greedy: the chosen token is the likeliest
            for token_id, d in entry.items():
                assert token_id.isdigit() and set(d) == {"logprob", "rank", "decoded_token"}
                assert isinstance(d["logprob"], float) and isinstance(d["rank"], int)
                assert d["decoded_token"] == tokenizer.decode([int(token_id)])
            chosen.append(int(next(iter(entry))))
            if logprobs:  # the alternatives are the likeliest, best first
                values = [d["logprob"] for d in entry.values()]
                assert values == sorted(values, reverse=True)
        assert chosen == response.as_numpy("output_ids").tolist()
    if logprobs is not None:
        ids = [t for r in responses for t in r.as_numpy("output_ids").tolist()]
        text = "".join(_as_text(r.as_numpy("text_output"))[0] for r in responses)
        assert (tokenizer.decode(ids) if stream else VLLM_PROMPT + tokenizer.decode(ids)) == text


def test_unrequested_outputs_are_absent(server):
    responses, error = grpc_generate(server, text_input=VLLM_PROMPT, stream=True,
                                     sampling_parameters=sampling(max_tokens=3), return_finish_reason=False)
    assert error is None
    for response in responses:
        for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens",
                     "num_cached_tokens", "output_ids"):
            assert response.as_numpy(name) is None


@pytest.mark.parametrize("stream", [True, False])
def test_num_cached_tokens_when_asked(server, stream):
    """FreeToken's num_cached_tokens (vLLM's RequestOutput field): one UINT32 per sample in every
    response. A prompt whose first page no earlier prompt had hits nothing; the same prompt again
    hits its cached pages if the server caches prefixes (it then publishes the vllm:prefix_cache_*
    counters, whose hits grow by exactly what the responses report), else nothing. 70 token ids:
    not a whole number of pages, so a repeat can use a snapshot at the last full page."""
    rng = random.Random(uuid.uuid4().int)
    prompt = [rng.randrange(256) for _ in range(70)]
    caching = "vllm:prefix_cache_hits_total" in server.metrics_text()
    hits_before = server.metric("vllm:prefix_cache_hits_total") if caching else 0.0
    reported = []
    for _ in range(2):
        responses, error = grpc_generate(server, input_ids=prompt, stream=stream, return_num_cached_tokens=True,
                                         sampling_parameters=sampling(max_tokens=3))
        assert error is None
        responses = [r for r in responses if r.as_numpy("text_output") is not None]
        assert responses and all(r.as_numpy("num_cached_tokens").dtype == np.uint32 for r in responses)
        (cached,) = {tuple(r.as_numpy("num_cached_tokens").tolist()) for r in responses}  # the same in each, n = 1
        assert len(cached) == 1 and 0 <= cached[0] < len(prompt)
        reported.append(cached[0])
    assert reported[0] == 0
    if caching:
        assert reported[1] > 0
        assert wait_for(lambda: server.metric("vllm:prefix_cache_hits_total") - hits_before == sum(reported))
    else:
        assert reported[1] == 0


# ----- n > 1 -----


def test_n_samples_draw_from_seed_plus_index(server):
    """vLLM's parallel sampling: sample i of a seeded request is the request seeded with seed + i;
    the non-streaming response holds the n texts, each after the prompt."""
    prompt = PROMPTS[0]

    def texts(params, **extra):
        responses, error = grpc_generate(server, text_input=prompt, sampling_parameters=json.dumps(params), **extra)
        assert error is None, error
        return responses

    (response,) = texts({"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 10}, return_finish_reason=True,
                        return_num_output_tokens=True, return_cumulative_logprob=True)
    together = _as_text(response.as_numpy("text_output"))
    assert len(together) == 3 and all(t.startswith(prompt) for t in together)
    assert len(set(together)) > 1  # different seeds, different samples
    assert all(r in ("stop", "length") for r in _as_text(response.as_numpy("finish_reason")))
    assert response.as_numpy("num_output_tokens").shape == (3,) and response.as_numpy("cumulative_logprob").shape == (3,)
    with ThreadPoolExecutor(3) as pool:
        alone = list(pool.map(lambda i: texts({"seed": 11 + i, "temperature": 1.0, "max_tokens": 10}), range(3)))
    assert together == [_as_text(r[0].as_numpy("text_output"))[0] for r in alone]

    streamed = texts({"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 10}, stream=True, return_finish_reason=True)
    streamed = [r for r in streamed if r.as_numpy("text_output") is not None]
    pieces = ["".join(_as_text(r.as_numpy("text_output"))[i] for r in streamed) for i in range(3)]
    assert [prompt + p for p in pieces] == together
    assert all(r != "None" for r in _as_text(streamed[-1].as_numpy("finish_reason")))


# ----- refusals and error texts -----


def test_lora_name_is_refused_with_the_vllm_backend_text(server):
    responses, error = grpc_generate(server, text_input="hi", sampling_parameters=sampling(lora_name="doll"))
    assert isinstance(error, InferenceServerException) and error.message() == "LoRA feature is not enabled."


def test_structured_outputs_are_refused_clearly(server):
    params = sampling(structured_outputs=json.dumps({"choice": ["Positive", "Negative"]}))
    responses, error = grpc_generate(server, text_input="hi", sampling_parameters=params)
    assert isinstance(error, InferenceServerException) and "'structured_outputs' is not supported" in error.message()


def test_streaming_without_excluding_the_input_has_the_vllm_backend_text(server):
    responses, error = grpc_generate(server, text_input="hi", stream=True, exclude_input_in_output=False,
                                     sampling_parameters=sampling(max_tokens=2))
    assert error.message() == "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."


# ----- metrics (ci/L0_backend_vllm/metrics_test) -----


def _series(server: Server) -> dict[str, float]:
    """``name{labels}`` -> value for every vllm:* and freetoken_* series."""
    values = {}
    for line in server.metrics_text().splitlines():
        match = re.match(r"^((?:vllm:|freetoken_)[^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if match:
            labels = [f'{k}="{v}"' for k, v in re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")
                      if k not in ("model", "version", "le", OWNER_LABEL)]
            key = match.group(1) + ("{" + ",".join(labels) + "}" if labels else "")
            if 'le="' not in (match.group(2) or ""):
                values[key] = float(match.group(3))
    return values


def _bucket_bounds(server: Server, family: str) -> list[float]:
    bounds = re.findall(rf'^{re.escape(family)}_bucket{{[^}}]*le="([^"]+)"', server.metrics_text(), re.MULTILINE)
    return [float(b) for b in bounds if b != "+Inf"]


def test_vllm_metrics_count_as_the_vllm_backend_does(server, demo_model):
    """Three prompts, twice, as vllm_metrics_test.py sends them (gRPC stream, non-streaming); counts
    are exact: one TTFT per request, one time-per-output-token per token after the first."""
    from transformers import AutoTokenizer

    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model))
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    max_tokens, rounds = 16, 2
    params = json.dumps({"temperature": "0", "top_p": "1", "max_tokens": max_tokens, "ignore_eos": True})
    wait_for(lambda: _series(server).get("vllm:num_requests_running") == 0)
    time.sleep(0.3)  # earlier requests' metrics are flushed every 100 ms
    before = _series(server)
    for _ in range(rounds):
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: grpc_generate(server, text_input=p, sampling_parameters=params), prompts))
        assert all(error is None for _, error in results)
    requests, tokens = len(prompts) * rounds, len(prompts) * rounds * max_tokens
    expected = {
        "vllm:prompt_tokens_total": prompt_tokens * rounds,
        "vllm:generation_tokens_total": tokens,
        "vllm:time_to_first_token_seconds_count": requests,
        "vllm:time_per_output_token_seconds_count": tokens - requests,
        "vllm:e2e_request_latency_seconds_count": requests,
        "vllm:request_prompt_tokens_count": requests,
        "vllm:request_prompt_tokens_sum": prompt_tokens * rounds,
        "vllm:request_generation_tokens_count": requests,
        "vllm:request_generation_tokens_sum": tokens,
        "vllm:request_params_n_count": requests,
        "vllm:request_params_n_sum": requests,
        'vllm:request_success_total{finished_reason="length"}': requests,
    }

    def delta(name: str) -> float:
        return _series(server).get(name, 0.0) - before.get(name, 0.0)

    wait_for(lambda: all(delta(name) == value for name, value in expected.items()))
    assert {name: delta(name) for name in expected} == expected
    for name in ("vllm:time_to_first_token_seconds_sum", "vllm:time_per_output_token_seconds_sum",
                 "vllm:e2e_request_latency_seconds_sum"):
        assert delta(name) > 0
    assert _bucket_bounds(server, "vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert _bucket_bounds(server, "vllm:time_per_output_token_seconds") == TPOT_BUCKETS
    assert _bucket_bounds(server, "vllm:e2e_request_latency_seconds") == E2E_BUCKETS
    assert _bucket_bounds(server, "vllm:request_params_n") == N_BUCKETS
    assert _bucket_bounds(server, "vllm:request_prompt_tokens")[:4] == [1, 2, 5, 10]


def test_every_family_once_under_one_name(server):
    text = server.metrics_text()
    exposed = set(re.findall(r"^# TYPE ((?:vllm:|freetoken_)\S+) (\w+)$", text, re.MULTILINE))
    prefix_cache = {(name, kind.lower()) for name, (kind, _, _) in PREFIX_CACHE_FAMILIES.items()}
    assert exposed & prefix_cache in (set(), prefix_cache)  # all of them while prefix caching is on, else none
    assert exposed - prefix_cache == {(name, kind.lower()) for name, (kind, _, _) in FAMILIES.items()}
    own = {name for name, _ in exposed - prefix_cache if name.startswith("freetoken_")}
    assert own == {"freetoken_kv_cache_pages_total", "freetoken_state_slots_used", "freetoken_state_slots_total"}
