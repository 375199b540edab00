"""Limits stated, not silent, and no head-of-line blocking, against the session's real tritonserver;
plus the launcher's port checks (no server needed to fail on a busy port)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

from freetoken.serving import launcher
from freetoken.serving.ports import busy_port, owns_listening_port

from .conftest import ENGINE_FLAGS, free_ports, sampling
from .test_server import grpc_generate, http_post, pools_idle, wait_for

CONTEXT = 4096  # the demo model's max_model_len; --num-pages 512 x 16 tokens does not lower it


def test_prompt_over_the_byte_limit_is_refused_at_once(server):
    started = time.monotonic()
    status, body = http_post(server, "generate", {"text_input": "x" * (8 << 20), "sampling_parameters": sampling(max_tokens=2)})
    assert status == 400 and "bytes; at most" in body["error"] and f"{CONTEXT}-token context" in body["error"], body
    assert time.monotonic() - started < 3.0
    status, body = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=2)})
    assert status == 200, body


def test_long_prompts_do_not_block_a_short_one(server):
    """Prompts just under the byte limit take 0.1-1 s each to tokenize (CI to a loaded laptop): off
    execute(), on a lane of their own, so a short request sent after six of them is answered before
    the last is refused. Behind them in one queue it would finish last, whatever the machine's speed."""
    big = ("The quick brown fox jumps over the lazy dog. " * 5000)[:200_000]
    finished: dict[str, float] = {}
    errors: list[str] = []

    def send(name: str, text: str, max_tokens: int) -> None:
        status, body = http_post(server, "generate", {"text_input": text, "sampling_parameters": sampling(max_tokens=max_tokens)})
        finished[name] = time.monotonic()
        if name.startswith("big"):
            assert status == 400, body
            errors.append(body["error"])
        else:
            assert status == 200, body

    started = time.monotonic()
    bigs = [f"big{i}" for i in range(6)]  # three rounds on the two large-prompt threads
    threads = [threading.Thread(target=send, args=(name, big, 4)) for name in bigs]
    for t in threads:
        t.start()
    time.sleep(0.05)
    send("small", "hi", 2)
    for t in threads:
        t.join(60)
    assert len(errors) == len(bigs) and all("text_input: prompt has" in e for e in errors), errors
    last_big = max(finished[name] for name in bigs)
    assert finished["small"] < last_big, {name: at - started for name, at in finished.items()}


def test_max_tokens_beyond_the_context_is_refused(server):
    for transport in ("http", "grpc"):
        for max_tokens in (5000, 10**30):
            if transport == "http":
                status, body = http_post(server, "generate", {"text_input": "The quick brown fox",
                                                              "sampling_parameters": sampling(max_tokens=max_tokens)})
                assert status == 400, body
                message = body["error"]
            else:
                responses, error = grpc_generate(server, text_input="The quick brown fox", stream=True,
                                                 sampling_parameters=sampling(max_tokens=max_tokens))
                assert error is not None and not responses
                message = error.message()
            assert "'max_tokens'" in message and f"exceed the {CONTEXT}-token context" in message, message
    status, body = http_post(server, "generate", {"input_ids": [5] * 10, "sampling_parameters": sampling(
        max_tokens=CONTEXT - 9)})  # one token too many
    assert status == 400 and f"the prompt's 10 tokens + max_tokens {CONTEXT - 9} = {CONTEXT + 1}" in body["error"], body
    assert wait_for(lambda: pools_idle(server), timeout=10)


def test_page_count_means_usable_pages(server):
    assert server.metric("freetoken_kv_cache_pages_total") == 512  # ENGINE_FLAGS: --num-pages 512


def test_busy_port_fails_at_once_naming_it(tmp_path):
    http, grpc, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "freetoken.cli", "serve", *ENGINE_FLAGS, "--host", "127.0.0.1",
             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"the gRPC port 127.0.0.1:{grpc} is not available: already in use" in result.stderr
    assert "ready:" not in result.stderr and "starting:" not in result.stderr
    assert time.monotonic() - started < 60
    assert busy_port("127.0.0.1", {"HTTP": http, "gRPC": http}) == f"the gRPC port {http} is also the HTTP port"


def test_ready_probe_identifies_its_own_server():
    """Only the process holding the listening socket counts: another server answering on the port does not."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert owns_listening_port(launcher.os.getpid(), port)
            assert not owns_listening_port(other.pid, port)
        finally:
            other.kill()
            other.wait()
    assert not owns_listening_port(launcher.os.getpid(), port)  # closed


def test_ready_line_names_metrics_only_when_served():
    args = argparse.Namespace(model_name="m", http_port=1, grpc_port=2, metrics_port=3, host="0.0.0.0",
                              report_metrics=True, tritonserver_arg=[])
    assert "metrics http://127.0.0.1:3/metrics" in launcher._ready_line(args, "127.0.0.1")
    args.report_metrics = False
    assert "Triton's only" in launcher._ready_line(args, "127.0.0.1")
    args.tritonserver_arg = ["--allow-metrics=false"]
    assert "metrics" not in launcher._ready_line(args, "127.0.0.1")


def test_grpc_stream_errors_carry_status_codes_when_asked(server):
    """Triton's stream protocol has no code field; a client starting its stream with the header
    ``triton_grpc_error: true`` gets the error's code as the gRPC status (and the stream closes)."""
    import queue

    import grpc
    import tritonclient.grpc as grpcclient

    from .test_server import grpc_inputs

    for params, code in ((sampling(top_p=5), grpc.StatusCode.INVALID_ARGUMENT),
                         (sampling(max_tokens=10**30), grpc.StatusCode.INVALID_ARGUMENT)):
        events: queue.SimpleQueue = queue.SimpleQueue()
        client = grpcclient.InferenceServerClient(server.grpc)
        client.start_stream(callback=lambda result, error: events.put((result, error)),
                            headers={"triton_grpc_error": "true"})
        try:
            client.async_stream_infer(server.model, grpc_inputs(text_input="hi", stream=True, sampling_parameters=params),
                                      enable_empty_final_response=True)
            _, error = events.get(timeout=30)
        finally:
            client.stop_stream()
            client.close()
        assert error is not None and error.status() == str(code), (error, error and error.status())
    status, body = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=2)})
    assert status == 200, body
