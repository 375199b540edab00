"""The launcher's ports: free before tritonserver starts, and held by *its* tritonserver when it
announces ready (a server already listening there answers the same ready URL)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path


def busy_port(host: str, ports: dict[str, int]) -> str | None:
    """A message naming the first of ``ports`` (name -> port) that cannot be bound on ``host``, or None."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            return f"the {name} port {port} is also the {seen[port]} port"
        seen[port] = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                probe.bind((host, port))
            except OSError as exc:
                reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                return f"the {name} port {host}:{port} is not available: {reason}"
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes


def owns_listening_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port`` (Linux /proc)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[len("socket:["):-1] in inodes:
            return True
    return False
