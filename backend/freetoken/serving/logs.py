"""Python logging into Triton's log, so the server log shows FreeToken's lines."""

from __future__ import annotations

import logging
from typing import Any


class TritonLogHandler(logging.Handler):
    """Python logging -> Triton's log (``pb_utils.Logger``), so the server log shows FreeToken's."""

    def __init__(self, pb_utils: Any) -> None:
        super().__init__()
        self._log = pb_utils.Logger
        self.setFormatter(logging.Formatter("[freetoken] %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self._log.log_error(message)
            elif record.levelno >= logging.WARNING:
                self._log.log_warn(message)
            else:
                self._log.log_info(message)
        except Exception:
            self.handleError(record)


def install_log_handler(pb_utils: Any, level: int = logging.INFO) -> None:
    root = logging.getLogger("freetoken")
    if not any(isinstance(h, TritonLogHandler) for h in root.handlers):
        root.addHandler(TritonLogHandler(pb_utils))
    root.setLevel(level)
