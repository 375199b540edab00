"""``freetoken serve``: write a model repository, find a tritonserver, run it, stop it cleanly.

Only the standard library is imported at module level, so ``freetoken --help`` stays fast.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from freetoken.config import EngineConfig

logger = logging.getLogger("freetoken.serve")

MODEL_DIR_NAME = "freetoken"  # the template's folder in the model repository


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path | None  # None: the server's default (/opt/tritonserver/backends)
    lib_dirs: list[Path]  # shared libraries the server and its Python backend need
    source: str  # how it was found, for the log


@dataclass
class StubPython:
    """The interpreter whose packages the Python backend stub uses (it must have freetoken and numpy<2)."""

    executable: Path
    version: str  # "3.11": picks the stub build
    libdir: str  # its libpython's directory


def stub_python(executable: str | None = None) -> StubPython:
    """``executable`` (default: $FREETOKEN_STUB_PYTHON, else the running interpreter)."""
    executable = executable or os.environ.get("FREETOKEN_STUB_PYTHON")
    if not executable or Path(executable).resolve() == Path(sys.executable).resolve():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return StubPython(Path(sys.executable), version, sysconfig.get_config_var("LIBDIR") or "")
    query = "import sys, sysconfig; print(f'{sys.version_info[0]}.{sys.version_info[1]}'); print(sysconfig.get_config_var('LIBDIR') or '')"
    try:
        out = subprocess.run([executable, "-c", query], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"--stub-python {executable}: cannot run it: {exc}") from None
    version, libdir = (out.splitlines() + [""])[:2]
    return StubPython(Path(executable), version, libdir)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--model-name", default="freetoken", help="name clients use in URLs (default: freetoken)")
    group.add_argument("--host", default="0.0.0.0", help="address the HTTP, gRPC and metrics ports bind (default: 0.0.0.0)")
    group.add_argument("--http-port", type=int, default=8000)
    group.add_argument("--grpc-port", type=int, default=8001)
    group.add_argument("--metrics-port", type=int, default=8002)
    group.add_argument("--tritonserver", default=None,
                       help="the tritonserver binary (default: $FREETOKEN_TRITONSERVER, then PATH, then the nvidia-pytriton wheel's)")
    group.add_argument("--backend-directory", default=None,
                       help="Triton backends directory for a given tritonserver (default: $FREETOKEN_TRITON_BACKEND_DIR, "
                            "$TRITON_BACKEND_DIR, else the server's own)")
    group.add_argument("--stub-python", default=None,
                       help="interpreter whose packages the Python backend stub uses (default: $FREETOKEN_STUB_PYTHON, "
                            "else this one); it needs freetoken and numpy<2")
    group.add_argument("--model-repository", default=None,
                       help="where to write the model repository (default: a temporary directory, removed at exit)")
    group.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    group.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the model to load")
    group.add_argument("--stop-timeout", type=float, default=30.0,
                       help="seconds a stopping server gets before its processes are killed")
    group.add_argument("--tritonserver-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for tritonserver (repeatable), e.g. --tritonserver-arg=--log-info=false")
    _add_backend_flags(parser)


def _add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``BackendOptions`` field, written into config.pbtxt like the engine flags."""
    import dataclasses
    import typing

    from freetoken.triton.options import BackendOptions

    group = parser.add_argument_group("serving (config.pbtxt parameters)")
    hints = typing.get_type_hints(BackendOptions)
    for f in dataclasses.fields(BackendOptions):
        flag = "--" + f.name.replace("_", "-")
        help = f"{f.metadata['help']} (default: {f.default})"
        if hints[f.name] is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
        else:
            group.add_argument(flag, dest=f.name, type=hints[f.name], default=f.default, help=help)


# ----- finding tritonserver -----


def _cache_dir() -> Path:
    root = os.environ.get("FREETOKEN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "freetoken")
    return Path(root)


def _pytriton_install(version: str) -> TritonInstall | None:
    """The server inside the nvidia-pytriton wheel, with a writable backends copy holding the stub
    built for Python ``version`` ("3.11")."""
    try:
        import pytriton
    except ImportError:
        return None
    root = Path(pytriton.__file__).parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.exists():
        return None
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    backends = _cache_dir() / f"triton-backends-py{version}-{_file_tag(stub)}"
    if not (backends / "python" / "triton_python_backend_stub").exists():
        _cache_dir().mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="backends-", dir=_cache_dir()))
        shutil.copytree(root / "backends", staging / "b", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, staging / "b" / "python" / "triton_python_backend_stub")
        try:
            os.replace(staging / "b", backends)  # atomic: two servers starting at once both succeed
        except OSError:
            pass  # another process installed it first
        shutil.rmtree(staging, ignore_errors=True)
    return TritonInstall(binary, backends, [root.parent.parent / "nvidia_pytriton.libs"], "the nvidia-pytriton wheel")


def _file_tag(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size:x}{int(stat.st_mtime):x}"


def find_tritonserver(flag: str | None, backend_dir: str | None, python_version: str | None = None) -> TritonInstall:
    """Flag, then $FREETOKEN_TRITONSERVER, then PATH, then the nvidia-pytriton wheel (with its stub
    for ``python_version``, default this interpreter's)."""
    backend_dir = backend_dir or os.environ.get("FREETOKEN_TRITON_BACKEND_DIR") or os.environ.get("TRITON_BACKEND_DIR")
    for value, source in ((flag, "--tritonserver"), (os.environ.get("FREETOKEN_TRITONSERVER"), "$FREETOKEN_TRITONSERVER")):
        if value:
            path = Path(value)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"{source}: {value} is not an executable file")
            return TritonInstall(path.resolve(), Path(backend_dir) if backend_dir else None, [], source)
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), Path(backend_dir) if backend_dir else None, [], "PATH")
    install = _pytriton_install(python_version or f"{sys.version_info.major}.{sys.version_info.minor}")
    if install is None:
        raise FileNotFoundError(
            "no tritonserver found: pass --tritonserver, set FREETOKEN_TRITONSERVER, put one on PATH, "
            "or install the serve extra (pip install 'freetoken[serve]', which brings nvidia-pytriton)"
        )
    if backend_dir:
        install.backend_dir = Path(backend_dir)
    return install


def server_environment(install: TritonInstall, python: StubPython | None = None) -> dict[str, str]:
    """The stub embeds libpython and finds packages through the ``python3`` first on PATH (not
    PYTHONPATH): put the stub interpreter's bin first, and its libpython's directory first on
    LD_LIBRARY_PATH (else another libpython3.X loads and ``import ssl`` fails in the model)."""
    python = python or stub_python()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(python.executable.parent), env.get("PATH", "")])
    lib_dirs = [python.libdir, *map(str, install.lib_dirs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in lib_dirs if d)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ----- the model repository -----


def template_dir() -> Path:
    """The model_repository/freetoken template: shipped as package data, or the source checkout's."""
    packaged = Path(__file__).resolve().parent / "model_repository" / MODEL_DIR_NAME
    if (packaged / "config.pbtxt").exists():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "model_repository" / MODEL_DIR_NAME
    if (checkout / "config.pbtxt").exists():
        return checkout
    raise FileNotFoundError("the model repository template (model_repository/freetoken) is missing")


def write_model_repository(repo: Path, model_name: str, parameters: dict[str, str], template: Path | None = None) -> Path:
    """Copy the template into ``repo/model_name`` with ``parameters`` set in its config.pbtxt."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    template = template or template_dir()
    config = text_format.Parse((template / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    config.name = model_name
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    target = repo / model_name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(template, target, ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt"))
    header = "# Written by `freetoken serve` from model_repository/freetoken/config.pbtxt.\n"
    (target / "config.pbtxt").write_text(header + text_format.MessageToString(config))
    return target


def engine_parameters(config: EngineConfig, args: argparse.Namespace) -> dict[str, str]:
    import dataclasses

    from freetoken.triton.options import BackendOptions, to_parameters

    options = BackendOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BackendOptions)})
    options.validate()
    return to_parameters(config, options)


def resolve_model(config: EngineConfig) -> EngineConfig:
    """Absolute paths (the stub runs elsewhere); the demo model built here when none is given."""
    import dataclasses

    if config.model is None:
        from freetoken.demo import ensure_demo_model

        config = dataclasses.replace(config, model=str(ensure_demo_model()))
        logger.info("no --model given: serving the embedded demo model at %s", config.model)
    elif not Path(config.model).is_dir():
        raise FileNotFoundError(f"--model {config.model}: no such directory")
    config = dataclasses.replace(config, model=str(Path(config.model).resolve()))
    if config.tokenizer:
        config = dataclasses.replace(config, tokenizer=str(Path(config.tokenizer).resolve()))
    return config


# ----- running -----


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
    ]
    if install.backend_dir is not None:
        cmd.append(f"--backend-directory={install.backend_dir}")
    return cmd + list(args.tritonserver_arg)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ServerProcess:
    """tritonserver in its own process group, so that stopping it also reaches its stub processes."""

    def __init__(self, cmd: list[str], env: dict[str, str], shm_prefix: str) -> None:
        self.shm_prefix = shm_prefix
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.stop_requested: int | None = None

    def request_stop(self, signum: int) -> None:
        if self.stop_requested is not None:  # a second signal: no more waiting
            self.kill_group()
            return
        self.stop_requested = signum
        logger.info("received %s: stopping tritonserver (pid %d)", signal.Signals(signum).name, self.proc.pid)
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
        _warn_numpy()
        config = resolve_model(config)
        config.validate()
        parameters = engine_parameters(config, args)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error("%s", exc)
        return 2
    temporary = args.model_repository is None
    repo = Path(tempfile.mkdtemp(prefix="freetoken-repo-") if temporary else args.model_repository).resolve()
    repo.mkdir(parents=True, exist_ok=True)
    write_model_repository(repo, args.model_name, parameters)
    shm_prefix = f"freetoken{os.getpid()}_"
    cmd = tritonserver_command(install, repo, args, shm_prefix)
    logger.info("model repository %s; starting: %s", repo, " ".join(cmd))
    server = ServerProcess(cmd, server_environment(install, python), shm_prefix)
    previous = {s: signal.signal(s, lambda signum, _frame: server.request_stop(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _supervise(server, args)
    finally:
        server.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if temporary:
            shutil.rmtree(repo, ignore_errors=True)


def _supervise(server: ServerProcess, args: argparse.Namespace) -> int:
    host = _local(args.host)
    ready_url = f"http://{host}:{args.http_port}/v2/models/{args.model_name}/ready"
    started, announced, stop_deadline, gave_up = time.monotonic(), False, None, False
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
        elif not announced:
            if _ready(ready_url):
                announced = True
                logger.info(
                    "ready: model '%s' on HTTP http://%s:%d (POST /v2/models/%s/generate, /generate_stream), "
                    "gRPC %s:%d, metrics http://%s:%d/metrics (bound to %s)",
                    args.model_name, host, args.http_port, args.model_name, host, args.grpc_port, host, args.metrics_port,
                    args.host,
                )
            elif time.monotonic() - started > args.startup_timeout:
                logger.error("model not ready after %.0f s: stopping", args.startup_timeout)
                gave_up = True
                server.request_stop(signal.SIGTERM)
    if gave_up:
        return 1
    if server.stop_requested is not None and code in (0, -signal.SIGTERM, -signal.SIGKILL):
        logger.info("tritonserver stopped")
        return 0
    logger.error("tritonserver exited with code %s", code)
    return code if code > 0 else 1


def _warn_numpy() -> None:
    try:
        import numpy
    except ImportError:
        return
    if int(numpy.__version__.split(".")[0]) >= 2:
        logger.warning("numpy %s: the Python backend stub of Triton 2.51 needs numpy<2 (tensors arrive corrupted)",
                       numpy.__version__)
