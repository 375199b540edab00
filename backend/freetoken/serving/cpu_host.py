"""tritonserver on a machine without a GPU: the flags that keep it from probing CUDA, and the one
error line it prints regardless.

A GPU build of tritonserver (the nvidia-pytriton wheel's, the NGC container's) started on a CPU host
warns about pinned memory, fails to start NVML and DCGM (`--allow-gpu-metrics=false` and a zero
pinned pool avoid those), and logs ``E ... server.cc:241] "CudaDriverHelper has not been
initialized."`` from its CUDA block manager, which it creates unconditionally; the server works.
``freetoken serve`` relays the server's output without that line on such a host, so that a healthy
CPU start shows no E-level line.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import IO

CPU_FLAGS = ["--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false"]
BENIGN_ON_CPU = ('"CudaDriverHelper has not been initialized."',)


def gpu_visible() -> bool:
    """An NVIDIA device node exists (no CUDA initialisation, no torch import)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def relay_output(stream: IO[bytes], drop: tuple[str, ...], out: IO[bytes] | None = None) -> threading.Thread:
    """Copy ``stream`` line by line to ``out`` (default: this process's stdout), leaving out lines
    that end with one of ``drop``; returns the started thread (it ends with the stream)."""
    target = out or sys.stdout.buffer
    suffixes = tuple(s.encode() for s in drop)

    def copy() -> None:
        for line in iter(stream.readline, b""):
            if not line.rstrip().endswith(suffixes):
                target.write(line)
                target.flush()
        stream.close()

    thread = threading.Thread(target=copy, name="tritonserver-output", daemon=True)
    thread.start()
    return thread
