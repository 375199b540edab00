"""The ``freetoken`` command: serve (in freetoken.serving.launcher), generate, bench (in freetoken.bench), demo-model."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from freetoken.config import EngineConfig
from freetoken.fields import add_flags, from_namespace
from freetoken.sampling_flags import add_sampling_flags, sampling_params_from_args


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field: ``max_prefill_length`` -> ``--max-prefill-length``."""
    add_flags(parser.add_argument_group("engine"), EngineConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return from_namespace(EngineConfig, args)


def _generate(args: argparse.Namespace) -> int:
    """Bad values (a flag out of range, a missing model directory) end in one line, not a traceback."""
    try:
        params = sampling_params_from_args(args)
        config = engine_config_from_args(args)
        config.validate()
        if config.model is not None and not Path(config.model).is_dir():
            raise FileNotFoundError(f"--model {config.model}: no such directory")
        from freetoken.llm import LLM

        llm = LLM(**dataclasses.asdict(config))
        outputs = llm.generate(args.prompt, params)
    except (ValueError, OSError) as exc:
        print(f"freetoken generate: error: {exc}", file=sys.stderr)
        return 2
    for output in outputs:
        print(output.text)
        print(f"[{output.finish_reason.value}: {len(output.token_ids)} tokens]", file=sys.stderr)
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from freetoken.demo import ensure_demo_model

    path = ensure_demo_model(args.dir, args.family)
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from freetoken.serving.launcher import serve

    return serve(engine_config_from_args(args), args)


def build_parser() -> argparse.ArgumentParser:
    from freetoken import __version__

    parser = argparse.ArgumentParser(prog="freetoken", description=__doc__)
    parser.add_argument("--version", action="version", version=f"freetoken {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text offline from one or more prompts")
    add_engine_flags(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several; required)")
    add_sampling_flags(generate)
    generate.set_defaults(run=_generate)

    from freetoken.serving.flags import add_serve_flags  # no torch: --help stays fast

    serve = commands.add_parser("serve", help="serve a model with Triton Inference Server (the demo model if no --model)")
    add_engine_flags(serve)
    add_serve_flags(serve)
    serve.set_defaults(run=_serve)

    from freetoken.bench.offline import add_bench_flags, run_bench  # standard library only at import

    bench = commands.add_parser("bench", help="offline decode latency and throughput against the HBM floor")
    add_engine_flags(bench)
    add_bench_flags(bench)
    bench.set_defaults(run=run_bench)

    demo = commands.add_parser("demo-model", help="build the embedded tiny demo checkpoint (no downloads)")
    demo.add_argument("dir", nargs="?", default=None, help="where to write it (default: the cache)")
    demo.add_argument("--family", choices=["qwen3_5_moe", "qwen4_exp"], default="qwen3_5_moe",
                      help="the model family (default: qwen3_5_moe)")
    demo.set_defaults(run=_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
