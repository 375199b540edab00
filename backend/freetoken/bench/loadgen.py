"""A small closed-loop load client for a FreeToken (or vLLM-backend) Triton model over gRPC streams.

``python -m freetoken.bench.loadgen --url localhost:8001 --concurrency 8 --requests 64``

Each of ``concurrency`` workers keeps one request in flight on its own gRPC stream. Requests come
from a perf_analyzer input-data file (``--input-data``, the format of perf_analyzer_configs/) or
from ``--prompt``/``--max-tokens``, or, with ``--shared-prefix-tokens C``, are ``--prompt-tokens``
random token ids whose first C are the same in every request (a system prompt shared by chats):
those ask for ``num_cached_tokens`` (FreeToken's output), whose mean the summary adds. Prints one
JSON summary (throughput, TTFT, inter-token latency); exits non-zero if any request failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Triton datatype of each input of the protocol (see model_repository/freetoken/config.pbtxt).
INPUT_TYPES = {"text_input": "BYTES", "sampling_parameters": "BYTES", "input_ids": "INT32"}


@dataclass
class Result:
    ok: bool
    error: str = ""
    latency: float = 0.0
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_cached_tokens: int | None = None  # when the request asked for it


def load_input_data(path: str | Path) -> list[dict[str, Any]]:
    """perf_analyzer's --input-data JSON: ``{"data": [{input: [values] | {"content": [...], "shape": [...]}}]}``."""
    document = json.loads(Path(path).read_text())
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected {{'data': [ ... ]}} with at least one entry")
    requests = []
    for index, entry in enumerate(entries):
        request = {}
        for name, value in entry.items():
            content = value["content"] if isinstance(value, dict) else value
            if not isinstance(content, list):
                raise ValueError(f"{path}: data[{index}].{name} must be a list or {{'content': [...]}}")
            request[name] = content
        requests.append(request)
    return requests


def _infer_inputs(grpcclient: Any, request: dict[str, list]) -> list[Any]:
    inputs = []
    for name, values in request.items():
        datatype = INPUT_TYPES.get(name, "BOOL")
        if datatype == "BYTES":
            array = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
        elif datatype == "INT32":
            array = np.array(values, dtype=np.int32)
        else:
            array = np.array(values, dtype=bool)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _worker(url: str, model: str, jobs: queue.SimpleQueue, results: list[Result], timeout: float) -> None:
    import tritonclient.grpc as grpcclient

    events: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((time.monotonic(), result, error)))
    try:
        while True:
            try:
                request_id, request = jobs.get_nowait()
            except queue.Empty:
                return
            request = {**request, "return_num_output_tokens": [True]}
            start = time.monotonic()
            client.async_stream_infer(model, _infer_inputs(grpcclient, request), request_id=str(request_id),
                                      enable_empty_final_response=True)
            result = Result(ok=True)
            while True:
                try:
                    when, response, error = events.get(timeout=timeout)
                except queue.Empty:
                    result = Result(ok=False, error=f"no response within {timeout} s")
                    break
                if error is not None:
                    result = Result(ok=False, error=str(error))
                    break
                cached = response.as_numpy("num_cached_tokens")
                if cached is not None:
                    result.num_cached_tokens = int(cached.sum())
                tokens = response.as_numpy("num_output_tokens")
                if tokens is not None and int(tokens.sum()) > 0:
                    result.ttft = result.ttft if result.ttft is not None else when - start
                    result.token_times.append(when)
                    result.num_tokens += int(tokens.sum())
                if response.get_response().parameters["triton_final_response"].bool_param:
                    break
            result.latency = time.monotonic() - start
            results.append(result)
    finally:
        client.stop_stream()
        client.close()


def run(url: str, model: str, requests: list[dict[str, list]], num_requests: int, concurrency: int,
        timeout: float = 300.0) -> dict[str, Any]:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for request_id, request in zip(range(num_requests), itertools.cycle(requests)):
        jobs.put((request_id, request))
    results: list[Result] = []
    start = time.monotonic()
    workers = [threading.Thread(target=_worker, args=(url, model, jobs, results, timeout)) for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    duration = time.monotonic() - start
    done = [r for r in results if r.ok]
    gaps = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    ttfts = sorted(r.ttft for r in done if r.ttft is not None)
    cached = [r.num_cached_tokens for r in done if r.num_cached_tokens is not None]

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "requests": len(results),
        "succeeded": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "output_tokens": sum(r.num_tokens for r in done),
        "output_tokens_per_s": sum(r.num_tokens for r in done) / duration if duration else 0.0,
        "requests_per_s": len(done) / duration if duration else 0.0,
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "inter_response_latency_mean_s": statistics.fmean(gaps) if gaps else None,
        "latency_mean_s": statistics.fmean(r.latency for r in done) if done else None,
        **({"num_cached_tokens_mean": statistics.fmean(cached)} if cached else {}),
    }


def shared_prefix_requests(count: int, prompt_tokens: int, prefix_tokens: int, max_tokens: int, vocab_size: int,
                           seed: int = 0) -> list[dict[str, list]]:
    """``count`` streaming requests of ``prompt_tokens`` random ids, the first ``prefix_tokens`` of
    them common to all, asking for ``num_cached_tokens``."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_tokens)]
    params = json.dumps({"max_tokens": max_tokens, "ignore_eos": True})
    return [{"input_ids": prefix + [rng.randrange(vocab_size) for _ in range(prompt_tokens - prefix_tokens)],
             "stream": [True], "sampling_parameters": [params], "return_num_cached_tokens": [True]}
            for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetoken.bench.loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="localhost:8001", help="gRPC address of the server")
    parser.add_argument("--model", default="freetoken")
    parser.add_argument("--input-data", help="perf_analyzer input-data JSON (see perf_analyzer_configs/)")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for any one response")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="random-id prompts whose first N tokens every request shares (0: off)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="with --shared-prefix-tokens: prompt length")
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="with --shared-prefix-tokens: ids are drawn below this (at most the model's vocabulary)")
    args = parser.parse_args(argv)
    if args.shared_prefix_tokens:
        if not 0 < args.shared_prefix_tokens <= args.prompt_tokens:
            parser.error(f"--shared-prefix-tokens must be in [1, --prompt-tokens {args.prompt_tokens}]")
        requests = shared_prefix_requests(args.requests, args.prompt_tokens, args.shared_prefix_tokens,
                                          args.max_tokens, args.vocab_size)
    elif args.input_data:
        requests = load_input_data(args.input_data)
    else:
        params = json.dumps({"max_tokens": args.max_tokens, "ignore_eos": True})
        requests = [{"text_input": [args.prompt], "stream": [True], "sampling_parameters": [params]}]
    summary = run(args.url, args.model, requests, args.requests, args.concurrency, args.timeout)
    print(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 and summary["succeeded"] == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
