"""One real tritonserver for the serving tests, started with ``freetoken serve`` on free loopback
ports (float32, CPU, the embedded demo model), plus the offline API's greedy texts to compare with."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from freetoken.demo import ensure_demo_model

pytest.importorskip("tritonclient.grpc", reason="needs the serve extra (tritonclient)")
pytest.importorskip("pytriton", reason="needs the serve extra (nvidia-pytriton ships tritonserver)")

# Prompts for the exactness checks (multibyte text included: deltas must never split a character).
PROMPTS = [
    "The quick brown fox",
    "Numbers: 0 1 2 3 42 1024",
    "Unicode: café naïve 日本語の文章 🙂",
    "def generate(prompt, max_tokens=16):",
    "Once upon a time there was",
    "Gated DeltaNet layers keep a recurrent state",
]
MAX_TOKENS = 24
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--max-running-requests", "16"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def descendants(pid: int) -> set[int]:
    """All processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie or a vanished process is not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@dataclass
class Server:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    model: str
    log_path: Path

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one series (summed over label sets matching ``labels``)."""
        total, found = 0.0, False
        for line in self.metrics_text().splitlines():
            match = re.match(r"^([\w:]+)(?:\{(.*)\})? (\S+)$", line)
            if not match or match.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total, found = total + float(match.group(3)), True
        if not found:
            raise KeyError(name)
        return total

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http}/v2/models/{self.model}/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(log_path: Path, extra: list[str] = (), model_name: str = "freetoken", timeout: float = 240) -> Server:
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", *ENGINE_FLAGS, "--host", "127.0.0.1",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--model-name", model_name, "--metrics-interval-ms", "100", *extra]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, http, grpc, metrics, model_name, log_path)
    deadline = time.monotonic() + timeout
    while not server.ready():
        if proc.poll() is not None:
            raise RuntimeError(f"freetoken serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()[-4000:]}")
        time.sleep(0.3)
    return server


def stop_server(server: Server, timeout: float = 60) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="session")
def server(demo_model, tmp_path_factory) -> Server:
    handle = start_server(tmp_path_factory.mktemp("server") / "serve.log")
    yield handle
    stop_server(handle)


@pytest.fixture(scope="session")
def reference(demo_model) -> dict[str, tuple[str, list[int]]]:
    """prompt -> (text, token ids) of the offline API's float32 greedy generation."""
    from freetoken import LLM, SamplingParams

    llm = LLM(model=str(demo_model), dtype="float32", device="cpu")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {p: (o.text, list(o.token_ids)) for p, o in zip(PROMPTS, outputs)}


def sampling(**values) -> str:
    return json.dumps(values)
