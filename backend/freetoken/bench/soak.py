"""Soak of the serving path: ``python -m freetoken.bench.soak --duration 300 [serve flags...]``.

Starts ``freetoken serve`` on free loopback ports (flags after ``--`` go to it), then for
``--duration`` seconds ``--concurrency`` clients send a random mix: gRPC streams (a share cancelled
mid-stream), HTTP ``/generate`` and ``/generate_stream``, and malformed requests; every
``--reload-every`` seconds the model is reloaded through the repository API (a changed seed). At
the end it checks that nothing hung or was lost (every request got a final response or an error,
malformed ones an error naming the field, valid ones outside reloads no error), that the pools are
back to empty, and reports the stub's and tritonserver's memory over the run. Exit 0 when all hold.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

MALFORMED = [
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "sampling_parameters"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"top_p": 7})}, "top_p"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"no_such_key": 1})}, "no_such_key"),
    ({"text_input": "hi", "input_ids": [1, 2]}, "exactly one"),
    ({"input_ids": [10**6]}, "input_ids"),
    ({"text_input": ""}, "text_input"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 10**30})}, "max_tokens"),
]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class Soak:
    def __init__(self, http: int, grpc: int, metrics: int, model: str, rng: random.Random) -> None:
        self.http, self.grpc, self.metrics, self.model, self.rng = http, grpc, metrics, model, rng
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.reloading = threading.Event()
        self._lock = threading.Lock()

    def record(self, outcome: str, failure: str | None = None) -> None:
        with self._lock:
            self.outcomes[outcome] += 1
            if failure is not None and not self.reloading.is_set():
                self.failures.append(failure)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))

    def _post(self, path: str, body: dict) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}/v2/models/{self.model}/{path}",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def one(self) -> None:
        kind = self.rng.choices(["grpc", "grpc_cancel", "generate", "generate_stream", "malformed"], [4, 2, 2, 1, 1])[0]
        params = json.dumps({"max_tokens": self.rng.randint(1, 48), "temperature": self.rng.choice([0, 0.8])})
        prompt = self.rng.choice(["The quick brown fox", "Unicode: café 日本語 🙂", "def f(x):", "Once upon a time"])
        if kind == "malformed":
            body, field = self.rng.choice(MALFORMED)
            status, text = self._post("generate", body)
            ok = status >= 400 and field in text
            self.record("malformed", None if ok else f"malformed {body} -> {status} {text[:200]}")
        elif kind in ("generate", "generate_stream"):
            status, text = self._post(kind, {"text_input": prompt, "sampling_parameters": params})
            self.record(kind if status == 200 else f"{kind}_error", None if status == 200 else f"{kind} {status} {text[:200]}")
        else:
            self._grpc(prompt, params, cancel=kind == "grpc_cancel")

    def _grpc(self, prompt: str, params: str, cancel: bool) -> None:
        import numpy as np
        import tritonclient.grpc as grpcclient

        def tensor(name: str, value: object, datatype: str) -> object:
            t = grpcclient.InferInput(name, [1], datatype)
            t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else bool))
            return t

        events: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc}")
        client.start_stream(callback=lambda result, error: events.put((result, error)))
        inputs = [tensor("text_input", prompt.encode(), "BYTES"), tensor("stream", True, "BOOL"),
                  tensor("sampling_parameters", params.encode(), "BYTES")]
        try:
            client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
            while True:
                result, error = events.get(timeout=120)
                if error is not None:
                    self.record("grpc_error", f"grpc error {error}")
                    return
                if cancel and self.rng.random() < 0.5:
                    client.stop_stream(cancel_requests=True)
                    self.record("grpc_cancelled")
                    return
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.record("grpc")
                    return
        except queue.Empty:
            self.record("hung", "a gRPC stream got no final response in 120 s")
        finally:
            client.stop_stream()
            client.close()

    def reload(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc}")
        config = client.get_model_config(self.model, as_json=True)["config"]
        config["parameters"]["seed"] = {"string_value": str(self.rng.randint(1, 10**6))}
        client.load_model(self.model, config=json.dumps(config))
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetoken.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--reload-every", type=float, default=60.0, help="seconds between reloads (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="after --: flags for freetoken serve")
    args = parser.parse_args(argv)
    http, grpc, metrics = _free_ports(3)
    log = tempfile.NamedTemporaryFile(prefix="freetoken-soak-", suffix=".log", delete=False)
    serve = subprocess.Popen([sys.executable, "-m", "freetoken.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http),
                              "--grpc-port", str(grpc), "--metrics-port", str(metrics), *args.serve_args],
                             stdout=log, stderr=subprocess.STDOUT)
    soak = Soak(http, grpc, metrics, "freetoken", random.Random(args.seed))
    try:
        deadline = time.monotonic() + 900
        while "ready:" not in Path(log.name).read_text(errors="replace"):
            if serve.poll() is not None or time.monotonic() > deadline:
                print(Path(log.name).read_text(errors="replace")[-3000:])
                return 1
            time.sleep(0.5)
        triton = _children(serve.pid)[0]
        memory: list[tuple[float, int | None, int | None]] = []
        started = time.monotonic()
        end = started + args.duration

        def client() -> None:
            while time.monotonic() < end:
                try:
                    soak.one()
                except Exception as exc:  # noqa: BLE001 - a client-side failure is a finding, not a crash
                    soak.record("client_exception", f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        next_reload = started + args.reload_every if args.reload_every > 0 else float("inf")
        while time.monotonic() < end:
            stubs = _children(triton)
            memory.append((time.monotonic() - started, _rss_kib(stubs[-1]) if stubs else None, _rss_kib(triton)))
            if time.monotonic() >= next_reload:
                soak.reloading.set()
                soak.reload()
                time.sleep(2)
                soak.reloading.clear()
                soak.outcomes["reloads"] += 1
                next_reload = time.monotonic() + args.reload_every
            time.sleep(5)
        for t in threads:
            t.join(180)
        hung_threads = sum(t.is_alive() for t in threads)
        time.sleep(2)
        idle = {name: soak.metric(name) for name in ("vllm:kv_cache_usage_perc", "freetoken_state_slots_used",
                                                     "vllm:num_requests_running", "vllm:num_requests_waiting")}
        total = sum(v for k, v in soak.outcomes.items() if k != "reloads")
        print(f"{total} requests in {args.duration:.0f} s: {dict(sorted(soak.outcomes.items()))}")
        print(f"after: {idle}; server alive: {serve.poll() is None}; hung clients: {hung_threads}")
        print("memory (s, stub RSS MiB, tritonserver RSS MiB): " + ", ".join(
            f"({t:.0f}, {s / 1024 if s else 0:.0f}, {p / 1024 if p else 0:.0f})" for t, s, p in memory[:: max(1, len(memory) // 12)]))
        for failure in soak.failures[:10]:
            print("FAILURE:", failure)
        good = (not soak.failures and not hung_threads and serve.poll() is None and not any(idle.values())
                and soak.outcomes["hung"] == 0)
        return 0 if good else 1
    finally:
        serve.terminate()
        serve.wait(120)
        print(f"freetoken serve exited {serve.returncode}; log {log.name}")


if __name__ == "__main__":
    sys.exit(main())
