"""``freetoken serve``: write a model repository, find a tritonserver, run it, stop it cleanly."""

from __future__ import annotations

import argparse
import glob
import logging
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from freetoken.config import EngineConfig
from freetoken.serving.cpu_host import BENIGN_ON_CPU, CPU_FLAGS, gpu_visible, relay_output
from freetoken.serving import control
from freetoken.serving.control import LauncherControl
from freetoken.serving.install import TritonInstall, find_tritonserver, server_environment, stub_python, warn_numpy
from freetoken.serving.ports import busy_port, owns_listening_port
from freetoken.serving.repository import engine_parameters, resolve_model, write_model_repository

logger = logging.getLogger("freetoken.serve")

EXIT_MODEL_DEAD = 3  # the model can no longer serve (engine thread died, stub killed): restart the server
STOP_MARGIN_S = 5.0  # of --stop-timeout, kept for aborting, unloading and exiting after the drain


def drain_seconds(stop_timeout: float) -> float:
    """How long in-flight requests may run after SIGTERM before the model aborts them."""
    return max(0.0, stop_timeout - min(STOP_MARGIN_S, stop_timeout / 2))


def tritonserver_command(install: TritonInstall, repo: Path, args: argparse.Namespace, shm_prefix: str) -> list[str]:
    cmd = [
        str(install.binary),
        f"--model-repository={repo}",
        "--model-control-mode=explicit",  # lets the model unload itself (not ready) if its engine dies
        f"--load-model={args.model_name}",
        f"--http-address={args.host}",
        f"--http-port={args.http_port}",
        f"--grpc-address={args.host}",
        f"--grpc-port={args.grpc_port}",
        f"--metrics-address={args.host}",
        f"--metrics-port={args.metrics_port}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--log-verbose={args.log_verbose}",
        f"--exit-timeout-secs={max(1, math.ceil(args.stop_timeout))}",
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    if not gpu_visible():
        cmd += CPU_FLAGS
    return cmd + list(args.tritonserver_arg)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def metrics_enabled(args: argparse.Namespace) -> bool:
    """Whether tritonserver serves its metrics port (``--allow-metrics=false`` among the extra arguments turns it off)."""
    value = True
    for arg in args.tritonserver_arg:
        if arg.startswith("--allow-metrics="):
            value = arg.split("=", 1)[1].strip().lower() not in ("false", "0", "no", "off")
    return value


class ServerProcess:
    """tritonserver in its own process group, so that stopping it also reaches its stub processes."""

    def __init__(self, cmd: list[str], env: dict[str, str], shm_prefix: str,
                 control_dir: Path | None = None, stop_timeout: float = 30.0) -> None:
        self.shm_prefix = shm_prefix
        self.control = LauncherControl(control_dir) if control_dir is not None else None
        self.stop_timeout = stop_timeout
        if control_dir is not None:
            env = {**env, control.ENV: str(control_dir)}
        drop = () if gpu_visible() else BENIGN_ON_CPU
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE if drop else None,
                                     stderr=subprocess.STDOUT if drop else None)
        self.output = relay_output(self.proc.stdout, drop) if drop else None
        self.stop_requested: int | None = None

    def request_stop(self, signum: int, drain: float | None = None) -> None:
        """Tell the model how long in-flight requests may still run (default: from the stop timeout),
        then SIGTERM tritonserver."""
        if self.stop_requested is not None:  # a second signal: no more waiting
            self.kill_group()
            return
        self.stop_requested = signum
        drain = drain_seconds(self.stop_timeout) if drain is None else drain
        logger.info("received %s: stopping tritonserver (pid %d); requests in flight get %.1f s",
                    signal.Signals(signum).name, self.proc.pid, drain)
        if self.control is not None:
            self.control.request_stop(drain)
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cleanup(self) -> None:
        """After tritonserver exits: kill what is left of its group, remove its shared memory."""
        self.kill_group()
        if self.output is not None:
            self.output.join(timeout=5)
        for path in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
            try:
                os.remove(path)
            except OSError:
                pass


def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s freetoken serve: %(message)s")
    try:
        python = stub_python(args.stub_python)
        install = find_tritonserver(args.tritonserver, args.backend_directory, python.version)
        logger.info("tritonserver: %s (from %s); stub Python %s (%s)", install.binary, install.source,
                    python.version, python.executable)
        warn_numpy()
        config = resolve_model(config)
        config.validate()
        parameters = engine_parameters(config, args)
        ports = {"HTTP": args.http_port, "gRPC": args.grpc_port}
        if metrics_enabled(args):
            ports["metrics"] = args.metrics_port
        busy = busy_port(args.host, ports)
        if busy is not None:
            raise OSError(f"{busy}; is another server running? choose other ports (--http-port, --grpc-port, --metrics-port)")
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error("%s", exc)
        return 2
    temporary = args.model_repository is None
    repo = Path(tempfile.mkdtemp(prefix="freetoken-repo-") if temporary else args.model_repository).resolve()
    repo.mkdir(parents=True, exist_ok=True)
    write_model_repository(repo, args.model_name, parameters)
    shm_prefix = f"freetoken{os.getpid()}_"
    control_dir = Path(tempfile.mkdtemp(prefix="freetoken-control-"))
    cmd = tritonserver_command(install, repo, args, shm_prefix)
    logger.info("model repository %s; starting: %s", repo, " ".join(cmd))
    server = ServerProcess(cmd, server_environment(install, python), shm_prefix, control_dir, args.stop_timeout)
    previous = {s: signal.signal(s, lambda signum, _frame: server.request_stop(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(server, args)
    finally:
        server.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(control_dir, ignore_errors=True)
        if temporary:
            shutil.rmtree(repo, ignore_errors=True)


def _own_server_ready(server: ServerProcess, args: argparse.Namespace, ready_url: str) -> bool:
    """Ready, and answered by this launcher's tritonserver: its model instance registered in the
    control directory and its process listening on the HTTP port."""
    if server.control is not None and not server.control.instance_pids():
        return False
    return owns_listening_port(server.proc.pid, args.http_port) and _ready(ready_url)


def _ready_line(args: argparse.Namespace, host: str) -> str:
    line = (f"ready: model '{args.model_name}' on HTTP http://{host}:{args.http_port} "
            f"(POST /v2/models/{args.model_name}/generate, /generate_stream), gRPC {host}:{args.grpc_port}")
    if metrics_enabled(args):
        line += f", metrics http://{host}:{args.metrics_port}/metrics"
        if not args.report_metrics:
            line += " (Triton's only: --no-report-metrics)"
    return line + f" (bound to {args.host})"


def _supervise(server: ServerProcess, args: argparse.Namespace) -> int:
    host = _local(args.host)
    ready_url = f"http://{host}:{args.http_port}/v2/models/{args.model_name}/ready"
    started, announced, stop_deadline, gave_up, dead = time.monotonic(), False, None, False, None
    while True:
        try:
            code = server.proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if server.stop_requested is not None:
            stop_deadline = stop_deadline or time.monotonic() + args.stop_timeout
            if time.monotonic() > stop_deadline:
                logger.warning("tritonserver did not stop within %.0f s: killing it", args.stop_timeout)
                server.kill_group()
            continue
        dead = server.control.fatal() if server.control is not None else None
        if dead is not None:
            logger.error("model '%s' cannot serve any more: %s; stopping the server (exit %d) so that its "
                         "supervisor restarts it", args.model_name, dead, EXIT_MODEL_DEAD)
            server.request_stop(signal.SIGTERM, drain=0.0)
        elif not announced:
            if _own_server_ready(server, args, ready_url):
                announced = True
                logger.info("%s", _ready_line(args, host))
            elif time.monotonic() - started > args.startup_timeout:
                logger.error("model not ready after %.0f s: stopping", args.startup_timeout)
                gave_up = True
                server.request_stop(signal.SIGTERM)
    if gave_up:
        return 1
    if dead is not None:
        return EXIT_MODEL_DEAD
    if server.stop_requested is not None and code in (0, -signal.SIGTERM, -signal.SIGKILL):
        logger.info("tritonserver stopped")
        return 0
    logger.error("tritonserver exited with code %s", code)
    return code if code > 0 else 1

