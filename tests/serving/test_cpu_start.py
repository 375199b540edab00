"""A healthy start on a machine without a GPU shows no E-level line and no NVML/DCGM failure."""

from __future__ import annotations

import io
import os
import re

import pytest

from freetoken.serving.cpu_host import BENIGN_ON_CPU, gpu_visible, relay_output


def test_relay_drops_only_the_benign_lines():
    r, w = os.pipe()
    with os.fdopen(w, "wb") as writer:
        writer.write(b'I1201 server.cc:1] "kept"\nE1201 server.cc:241] "CudaDriverHelper has not been initialized."\n'
                     b'E1201 model.py:9] "a real error"\n')
    out = io.BytesIO()
    relay_output(os.fdopen(r, "rb"), BENIGN_ON_CPU, out).join(timeout=5)
    assert out.getvalue() == b'I1201 server.cc:1] "kept"\nE1201 model.py:9] "a real error"\n'


def test_cpu_start_log_is_clean(server):
    if gpu_visible():
        pytest.skip("this machine has a GPU")
    log = server.log()
    assert "ready: model" in log
    errors = [line for line in log.splitlines() if re.match(r"^E\d{4} ", line) or "NVML" in line or "DCGM" in line
              or "pinned system memory" in line]
    assert errors == []
