"""Finding a tritonserver install and the interpreter its Python backend stub runs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("freetoken.serve")


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


def warn_numpy() -> None:
    """Warn when this interpreter has numpy 2: a stub using its packages (the default) gets corrupted tensors."""
    try:
        import numpy
    except ImportError:
        return
    if int(numpy.__version__.split(".")[0]) >= 2:
        logger.warning("numpy %s: the Python backend stub of Triton 2.51 needs numpy<2 (tensors arrive corrupted)",
                       numpy.__version__)
