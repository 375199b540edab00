"""The control directory that ``freetoken serve`` shares with the model instances it runs.

Triton 2.51 tells neither side what the other needs: its readiness stays true when a backend stub is
killed (an OOM kill), and on SIGTERM it waits for in-flight requests without telling the model, then
exits under it. So the launcher creates a directory, passes it to tritonserver (and so to every stub)
in ``$FREETOKEN_CONTROL_DIR``, and both sides speak through files in it:

- ``stub-<pid>``: written by each model instance at ``initialize``, removed at ``finalize``. One whose
  process is gone means the stub died without finalizing (killed).
- ``dead-<pid>``: written by an instance whose engine thread died; holds the reason. Never removed.
- ``stop``: written by the launcher on SIGTERM; holds the wall-clock deadline (``time.time()``) by
  which instances must have finished or aborted what is in flight.

Without the variable (tritonserver run by hand) the model works as before, minus these signals.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "FREETOKEN_CONTROL_DIR"
STOP = "stop"


def process_alive(pid: int) -> bool:
    """Running: a vanished process or a zombie (killed, not yet reaped by tritonserver) is not."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


class InstanceControl:
    """The model instance's side."""

    def __init__(self, model_name: str, directory: str | None = None) -> None:
        directory = directory if directory is not None else os.environ.get(ENV)
        self.directory = Path(directory) if directory else None
        self._own = self.directory / f"stub-{os.getpid()}" if self.directory else None
        if self._own is not None:
            self._own.write_text(model_name)

    def stop_deadline(self) -> float | None:
        """The launcher's stop deadline (``time.time()`` scale), or None while not stopping."""
        if self.directory is None:
            return None
        try:
            return float((self.directory / STOP).read_text())
        except (OSError, ValueError):
            return None

    def report_death(self, reason: str) -> None:
        if self.directory is not None:
            (self.directory / f"dead-{os.getpid()}").write_text(reason)

    def close(self) -> None:
        if self._own is not None:
            self._own.unlink(missing_ok=True)
            self._own = None


class LauncherControl:
    """The launcher's side."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def request_stop(self, drain_seconds: float) -> None:
        tmp = self.directory / f"{STOP}.tmp"
        tmp.write_text(repr(time.time() + drain_seconds))
        tmp.replace(self.directory / STOP)  # atomic: a reader never sees half a number

    def instance_pids(self) -> list[int]:
        return [int(p.name.split("-", 1)[1]) for p in self.directory.glob("stub-*")]

    def fatal(self) -> str | None:
        """Why the model can no longer serve (an engine thread died, a stub was killed), or None."""
        for path in sorted(self.directory.glob("dead-*")):
            return f"its engine thread died (stub pid {path.name.split('-', 1)[1]}): {path.read_text(errors='replace')}"
        for path in sorted(self.directory.glob("stub-*")):
            pid = int(path.name.split("-", 1)[1])
            if not process_alive(pid) and path.exists():  # exists: not a finalize that just ended
                return f"its Python backend stub (pid {pid}) died without finalizing (killed, out of memory?)"
        return None
