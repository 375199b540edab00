"""The freetoken command and the package's installability."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken import EngineConfig
from freetoken.cli import build_parser, engine_config_from_args

ROOT = Path(__file__).resolve().parents[1]


def _freetoken(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freetoken.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_prints_text(demo_checkpoint):
    done = _freetoken("generate", "--model", str(demo_checkpoint), "--prompt", "The quick", "--max-tokens", "5",
                      "--dtype", "float32", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert re.search(r"\[(length|stop): \d+ tokens\]", done.stderr)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen4_exp"])
def test_demo_model_builds_a_checkpoint_that_generates(tmp_path, family):
    done = _freetoken("demo-model", str(tmp_path / "demo"), "--family", family)
    assert done.returncode == 0, done.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "demo" / name).exists()
    done = _freetoken("generate", "--model", str(tmp_path / "demo"), "--prompt", "The quick", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr


def test_every_engine_option_is_a_flag():
    help_text = build_parser().parse_args(["generate", "--prompt", "x"])
    for name in EngineConfig.option_names():
        assert hasattr(help_text, name)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--max-prefill-length", "16"])
    assert args.max_prefill_length == 16


def test_serve_flags_become_parameters_the_backend_reads_back():
    """Flags, config.pbtxt parameters and the options read from them agree on every field (bool and Literal too)."""
    from freetoken.serving.options import BackendOptions, options_from_model_config
    from freetoken.serving.repository import engine_parameters

    args = build_parser().parse_args(["serve", "--dtype", "float32", "--num-pages", "64", "--no-report-metrics",
                                      "--response-threads", "3", "--cancel-poll-ms", "50"])
    config = engine_config_from_args(args)
    parameters = engine_parameters(config, args)
    assert parameters["report_metrics"] == "false" and parameters["max_model_len"] == ""
    read = options_from_model_config({"parameters": {k: {"string_value": v} for k, v in parameters.items()}})
    assert read == (config, BackendOptions(response_threads=3, cancel_poll_ms=50.0, report_metrics=False))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "fp8"])


def test_pyproject_lists_every_package():
    """Non-editable installs (wheels, the Docker image) ship only the packages pyproject lists."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, package_dirs = set(setuptools["packages"]), setuptools["package-dir"]

    def folder(package: str) -> Path:
        root = max((p for p in package_dirs if package == p or package.startswith(p + ".")), key=len)
        return ROOT / package_dirs[root] / Path(*package[len(root) :].split(".")[1:])

    for name in listed:
        assert folder(name).is_dir(), f"pyproject lists {name}, but {folder(name)} does not exist"
    found = {
        ".".join([root, *init.parent.relative_to(ROOT / package_dirs[root]).parts])
        for root in ("freetoken", "freetoken.kernels")
        for init in (ROOT / package_dirs[root]).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
