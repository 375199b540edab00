"""Server lifecycles of their own: ``freetoken serve`` stopped by SIGTERM, and an engine thread
that dies under load (reported to the launcher's control directory)."""

from __future__ import annotations

import glob
import shutil
import signal
import threading
import time
from pathlib import Path

from freetoken.cli import build_parser, engine_config_from_args
from freetoken.serving import launcher, repository
from freetoken.serving.install import find_tritonserver, server_environment

from .conftest import ENGINE_FLAGS, Server, alive, descendants, free_ports, start_server, stop_server
from .test_server import grpc_generate, http_post, sampling, wait_for


DYING_MODEL = Path(__file__).with_name("dying_model.py")  # copied in as 1/model.py, not imported here
DEATH_IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def test_serve_sigterm_stops_every_process(demo_model, tmp_path):
    server = start_server(tmp_path / "serve.log")
    try:
        status, body = http_post(server, "generate", {"text_input": "hi", "sampling_parameters": sampling(max_tokens=4)})
        assert status == 200, body
        processes = descendants(server.proc.pid)
        assert len(processes) >= 2  # tritonserver and its Python backend stub
        shm_prefix = f"freetoken{server.proc.pid}_"
        assert glob.glob(f"/dev/shm/{shm_prefix}*")
        announced = f"HTTP http://127.0.0.1:{server.http_port}"  # the launcher polls readiness itself, a bit later
        assert wait_for(lambda: announced in server.log(), timeout=10)
        assert f"gRPC 127.0.0.1:{server.grpc_port}" in server.log()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert not [pid for pid in processes if alive(pid)]
        assert not glob.glob(f"/dev/shm/{shm_prefix}*")
        assert "tritonserver stopped" in server.log()
    finally:
        stop_server(server)


def test_engine_death_fails_requests_and_unloads_the_model(demo_model, tmp_path):
    """Requests in flight get errors, later ones are refused, the model turns not ready; nothing hangs."""
    http, grpc, metrics = free_ports(3)
    args = build_parser().parse_args(["serve", *ENGINE_FLAGS, "--model", str(demo_model), "--host", "127.0.0.1",
                                      "--http-port", str(http), "--grpc-port", str(grpc),
                                      "--metrics-port", str(metrics), "--model-name", "dying"])
    config = repository.resolve_model(engine_config_from_args(args))
    repo = tmp_path / "repo"
    target = repository.write_model_repository(repo, "dying", repository.engine_parameters(config, args))
    assert f"DEATH_IDS = {DEATH_IDS}" in DYING_MODEL.read_text()
    shutil.copy(DYING_MODEL, target / "1" / "model.py")
    install = find_tritonserver(None, None)
    prefix = f"freetokentest{http}_"
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    process = launcher.ServerProcess(launcher.tritonserver_command(install, repo, args, prefix),
                                     server_environment(install), prefix, control_dir)
    server = Server(process.proc, http, grpc, metrics, "dying", tmp_path / "unused.log")
    try:
        assert wait_for(server.ready, timeout=240, interval=0.3), "the model did not load"
        long_running = {}

        def stream():
            long_running["result"] = grpc_generate(server, timeout=60, text_input="The quick brown fox", stream=True,
                                                   sampling_parameters=sampling(max_tokens=4000, ignore_eos=True))

        thread = threading.Thread(target=stream)
        thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        status, body = http_post(server, "generate", {"input_ids": DEATH_IDS}, timeout=60)
        assert status >= 400 and "engine" in body["error"], body
        thread.join(timeout=60)
        assert not thread.is_alive()
        responses, error = long_running["result"]
        assert error is not None and "engine" in error.message() and responses  # it had been streaming
        assert wait_for(lambda: not server.ready(), timeout=30)
        fatal = process.control.fatal()  # what makes `freetoken serve` exit 3
        assert fatal is not None and "engine thread died" in fatal and "injected engine failure" in fatal, fatal
        status, body = http_post(server, "generate", {"text_input": "hi"}, timeout=30)
        assert status >= 400  # the model is gone: Triton answers for it
        assert time.monotonic() - started < 60
        assert process.proc.poll() is None  # the server itself keeps running
    finally:
        process.request_stop(signal.SIGTERM)
        try:
            process.proc.wait(timeout=60)
        finally:
            process.cleanup()
