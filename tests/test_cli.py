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


def test_help_loads_neither_torch_nor_transformers():
    """`freetoken --help` stays well under a second: the engine is imported on first use only."""
    code = ("import sys, freetoken, freetoken.cli; freetoken.cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert _freetoken("--version").stdout.strip() == f"freetoken {__import__('freetoken').__version__}"


@pytest.mark.parametrize("command", ["generate", "serve", "demo-model"])
def test_every_flag_has_help_with_its_default(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest not in ("help", "prompt"):
            assert action.help and "default" in action.help, f"{command} {action.option_strings[0]}: {action.help!r}"
            assert action.help.count("default") == 1, f"{command} {action.option_strings[0]} shows two defaults"


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "sampling parameter 'top_p' must be in (0, 1], got 1.5"),
    (["--presence-penalty", "3"], "sampling parameter 'presence_penalty' must be in [-2, 2]"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    (["--max-running-requests", "0"], "max_running_requests must be >= 1"),
])
def test_generate_bad_values_end_in_one_line(flags, message):
    done = _freetoken("generate", "--prompt", "x", *flags)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"freetoken generate: error: {done.stderr.split('error: ', 1)[1].strip()}"]
    assert message in done.stderr and "Traceback" not in done.stderr


def test_generate_sampling_flags_are_sampling_params():
    from freetoken import SamplingParams
    from freetoken.sampling_flags import sampling_params_from_args

    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--min-p", "0.1",
        "--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--max-tokens", "9",
        "--min-tokens", "2", "--stop", "a", "--stop", "bc", "--stop-token-id", "3", "--include-stop-str-in-output",
        "--ignore-eos", "--seed", "11"])
    assert sampling_params_from_args(args) == SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, max_tokens=9, min_tokens=2, stop=["a", "bc"], stop_token_ids=[3],
        include_stop_str_in_output=True, ignore_eos=True)
    assert engine_config_from_args(args).seed == 11  # the engine's seed seeds each prompt's sampling


@pytest.mark.slow
def test_generate_sampling_flags_match_the_offline_api(demo_checkpoint):
    from freetoken import LLM, SamplingParams

    flags = ["--temperature", "0.8", "--min-p", "0.05", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
             "--frequency-penalty", "0.3", "--max-tokens", "12", "--seed", "7"]
    done = _freetoken("generate", "--model", str(demo_checkpoint), "--prompt", "The quick", "--dtype", "float32",
                      "--device", "cpu", *flags)
    assert done.returncode == 0, done.stderr
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", seed=7)
    params = SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                            frequency_penalty=0.3, max_tokens=12)
    (expected,) = llm.generate("The quick", params)
    assert done.stdout == expected.text + "\n"
