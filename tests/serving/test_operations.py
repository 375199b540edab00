"""What an operator does to a running server, against the real tritonserver: reload, unload and load
the model under traffic with metrics on (also a second copy beside it and an ensemble holding it),
kill its stub, stop the server with long generations in flight. Each starts a server of its own."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time

import pytest
import tritonclient.grpc as grpcclient

from .conftest import Server, alive, descendants, start_server, stop_server
from .test_server import grpc_generate, http_post, pools_idle, sampling, wait_for

ENSEMBLE_CONFIG = """
name: "ensemble"
platform: "ensemble"
max_batch_size: 0
input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] },
        { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] } ]
ensemble_scheduling { step [ {
  model_name: "freetoken", model_version: -1,
  input_map { key: "text_input", value: "text_input" },
  input_map { key: "sampling_parameters", value: "sampling_parameters" },
  output_map { key: "text_output", value: "text_output" } } ] }
"""


class Traffic:
    """gRPC streams one after another on a thread, each recorded as (start, end, error or None)."""

    def __init__(self, server: Server, model: str = "freetoken") -> None:
        self.server, self.model = server, model
        self.results: list[tuple[float, float, Exception | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            server = Server(self.server.proc, self.server.http_port, self.server.grpc_port, self.server.metrics_port,
                            self.model, self.server.log_path)
            responses, error = grpc_generate(server, timeout=120, text_input="The quick brown fox", stream=True,
                                             sampling_parameters=sampling(temperature=0, max_tokens=24))
            assert error is not None or responses  # grpc_generate returns only on the final flag or an error
            self.results.append((start, time.monotonic(), error))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive(), "a request hung"

    def errors_outside(self, windows: list[tuple[float, float]]) -> list[Exception]:
        return [e for s, t, e in self.results if e is not None and not any(s < b and t > a for a, b in windows)]


def stub_pids(server: Server) -> list[int]:
    pids = []
    for pid in descendants(server.proc.pid):
        try:
            if b"triton_python_backend_stub" in open(f"/proc/{pid}/cmdline", "rb").read() and alive(pid):
                pids.append(pid)
        except OSError:
            pass
    return pids


def series(server: Server, name: str) -> list[str]:
    return [line for line in server.metrics_text().splitlines() if re.match(rf"^{name}\{{", line)]


@pytest.mark.slow
def test_reload_unload_load_under_traffic_with_metrics_on(demo_model, tmp_path):
    repo = tmp_path / "repo"
    server = start_server(tmp_path / "serve.log", extra=["--model-repository", str(repo)])
    client = grpcclient.InferenceServerClient(server.grpc)
    unloaded: list[tuple[float, float]] = []
    try:
        with Traffic(server) as traffic:
            config = client.get_model_config("freetoken", as_json=True)["config"]
            for seed in (1, 2):  # a changed config: Triton starts a new instance, then finalizes the old one
                config["parameters"]["seed"] = {"string_value": str(seed)}
                client.load_model("freetoken", config=json.dumps(config))
                assert server.ready()
            # a second copy beside it (its own stub, same metric families), loaded and unloaded under traffic
            shutil.copytree(repo / "freetoken", repo / "freetoken_b")
            pbtxt = repo / "freetoken_b" / "config.pbtxt"
            pbtxt.write_text(re.sub(r'^name: "freetoken"', 'name: "freetoken_b"', pbtxt.read_text(), flags=re.M))
            client.load_model("freetoken_b")
            with Traffic(server, "freetoken_b") as second:
                time.sleep(3)
            client.unload_model("freetoken_b")
            assert second.results and not second.errors_outside([])
            # an ensemble holding it, as Triton's vLLM-backend CI loads one
            (repo / "ensemble" / "1").mkdir(parents=True)
            (repo / "ensemble" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
            client.load_model("ensemble")
            status, body = http_post(Server(server.proc, server.http_port, server.grpc_port, server.metrics_port,
                                            "ensemble", server.log_path),
                                     "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=4)})
            assert status == 200 and body["text_output"], body
            client.unload_model("ensemble")
            # unload (in-flight requests end, later ones are refused) and load back
            began = time.monotonic()
            client.unload_model("freetoken")
            assert wait_for(lambda: not server.ready(), timeout=60)
            client.load_model("freetoken")
            unloaded.append((began, time.monotonic()))
            assert server.ready()
            time.sleep(2)
        assert len(traffic.results) > 10
        assert not traffic.errors_outside(unloaded), traffic.errors_outside(unloaded)[:3]
        assert server.proc.poll() is None
        assert wait_for(lambda: pools_idle(server), timeout=15)
        pages = series(server, "freetoken_kv_cache_pages_total")  # one live instance: one owner's series
        assert len(pages) == 1 and f'stub_pid="{stub_pids(server)[0]}"' in pages[0], pages
        assert server.metric("vllm:request_success_total") > 0
    finally:
        code = stop_server(server)
    log = server.log()
    assert "Signal (" not in log.replace("Signal (15)", ""), log[-3000:]
    assert "malloc" not in log and code == 0


@pytest.mark.slow
def test_a_killed_stub_makes_serve_exit_non_zero_saying_why(demo_model, tmp_path):
    server = start_server(tmp_path / "serve.log")
    try:
        stubs = stub_pids(server)
        assert len(stubs) == 1
        processes = descendants(server.proc.pid)
        killed = time.monotonic()
        os.kill(stubs[0], signal.SIGKILL)  # as the OOM killer does
        assert server.proc.wait(timeout=60) == 3
        assert time.monotonic() - killed < 40
        assert f"stub (pid {stubs[0]}) died without finalizing" in server.log()
        assert not [pid for pid in processes if alive(pid)]
    finally:
        stop_server(server)


@pytest.mark.slow
def test_sigterm_ends_long_generations_with_a_final_error_and_exits_0(demo_model, tmp_path):
    server = start_server(tmp_path / "serve.log", extra=["--stop-timeout", "10"])
    results: dict[str, object] = {}
    long = sampling(max_tokens=4000, ignore_eos=True)

    def stream(i: int) -> None:
        results[f"grpc{i}"] = grpc_generate(server, timeout=60, text_input="The quick brown fox", stream=True,
                                            sampling_parameters=long)

    def generate(i: int) -> None:
        results[f"http{i}"] = http_post(server, "generate", {"text_input": "Once upon a time", "sampling_parameters": long},
                                        timeout=60)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    processes = descendants(server.proc.pid)
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: server.metric("vllm:num_requests_running") == 6, timeout=30)
        time.sleep(1)
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # no longer admitted: refused by the model, or the connection by the stopping server
            status, body = http_post(server, "generate", {"text_input": "hi"}, timeout=30)
            assert status >= 400, body
        except OSError:
            pass
        for t in threads:
            t.join(60)
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - stopped < 15
    finally:
        stop_server(server)
    for i in range(4):
        responses, error = results[f"grpc{i}"]
        assert responses and error is not None and "shutting down" in error.message(), error
    for i in range(2):
        status, body = results[f"http{i}"]
        assert status >= 400 and "shutting down" in body["error"], body
    log = server.log()
    assert "Signal (11)" not in log and "Signal (6)" not in log
    assert "tritonserver stopped" in log
    assert not [pid for pid in processes if alive(pid)]
