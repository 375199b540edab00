"""perf_analyzer and genai-perf, as perf_analyzer_configs/ runs them, against `freetoken serve` on the
demo model; their reports are checked, and the server's own token count shows that no request
stopped at EOS. The tools come from scripts/setup-tools.sh (.tools-venv, or $FREETOKEN_TOOLS_VENV)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Server
from .test_server import pools_idle, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("FREETOKEN_TOOLS_VENV", REPO_ROOT / ".tools-venv")).resolve()
OUTPUT_TOKENS = 64  # max_tokens (and ignore_eos) in perf_analyzer_configs/input_data_stream.json

pytestmark = pytest.mark.slow


def run_config(script: str, server: Server, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    if not (TOOLS / "bin" / "perf_analyzer").exists():
        pytest.skip(f"no benchmark tools at {TOOLS}: run scripts/setup-tools.sh")
    shutil.copytree(REPO_ROOT / "perf_analyzer_configs", cwd / "perf_analyzer_configs", dirs_exist_ok=True)
    environment = dict(os.environ, PATH=f"{TOOLS / 'bin'}{os.pathsep}{os.environ['PATH']}", MODEL=server.model,
                       URL=server.grpc, METRICS_URL=f"http://127.0.0.1:{server.metrics_port}/metrics", **env)
    environment.pop("VIRTUAL_ENV", None)
    run = subprocess.run(["bash", f"perf_analyzer_configs/{script}"], cwd=cwd, env=environment,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run


def generated_tokens(server: Server) -> float:
    assert wait_for(lambda: pools_idle(server))
    return server.metric("vllm:generation_tokens_total")


def test_perf_analyzer_streams_at_concurrency_8(server, tmp_path):
    before = generated_tokens(server)
    run_config("perf_analyzer_stream.sh", server, tmp_path, CONCURRENCY="8", REQUESTS="32", STABILITY="100",
               STREAM_ONLY="1", EXPORT="export.json")
    (experiment,) = json.loads((tmp_path / "export.json").read_text())["experiments"]
    assert experiment["experiment"] == {"mode": "concurrency", "value": 8}
    requests = experiment["requests"]
    assert len(requests) >= 32
    for request in requests:  # decoupled streaming: several responses, each one's text
        assert len(request["response_timestamps"]) > 1
        assert all("text_output" in output for output in request["response_outputs"])
    # perf_analyzer also sends requests outside its measurement windows: at least every measured one
    # decoded all its tokens (ignore_eos in the input data)
    assert wait_for(lambda: generated_tokens(server) - before >= len(requests) * OUTPUT_TOKENS)
    assert (generated_tokens(server) - before) % OUTPUT_TOKENS == 0


def test_genai_perf_vllm_backend_profile(server, demo_model, tmp_path):
    before = generated_tokens(server)
    run = run_config("genai_perf.sh", server, tmp_path, TOKENIZER=str(demo_model), CONCURRENCY="8", REQUESTS="32",
                     OUTPUT_TOKENS=str(OUTPUT_TOKENS), ARTIFACTS=str(tmp_path / "artifacts"))
    assert "Time To First Token" in run.stdout
    (report,) = (tmp_path / "artifacts").glob("**/profile_export_genai_perf.json")
    summary = json.loads(report.read_text())
    assert summary["request_count"]["avg"] == 32
    assert summary["request_throughput"]["avg"] > 0 and summary["output_token_throughput"]["avg"] > 0
    assert 0 < summary["time_to_first_token"]["avg"] <= summary["request_latency"]["avg"]
    # min_tokens = max_tokens: every request decoded exactly OUTPUT_TOKENS, none stopped at EOS
    assert wait_for(lambda: generated_tokens(server) - before == 32 * OUTPUT_TOKENS)
