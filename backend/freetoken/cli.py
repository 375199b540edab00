"""The ``freetoken`` command: serve (in freetoken.triton.launcher), generate, demo-model."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, Literal

from freetoken.config import EngineConfig


def _flag_type(annotation: Any) -> tuple[type, list[str] | None]:
    """(argparse type, choices) of an EngineConfig annotation (``int | None``, ``Literal[...]``, ...)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str, list(typing.get_args(annotation))
    return annotation, None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field: ``max_prefill_length`` -> ``--max-prefill-length``."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag_type, choices = _flag_type(hints[f.name])
        if flag_type is bool:  # --overlap-schedule / --no-overlap-schedule
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{f.metadata['help']} (default: {f.default})",
            )
            continue
        group.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=flag_type,
            choices=choices,
            default=f.default,
            help=f"{f.metadata['help']} (default: {f.default})",
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.option_names()})


def _generate(args: argparse.Namespace) -> int:
    from freetoken.core import SamplingParams
    from freetoken.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    for output in llm.generate(args.prompt, params):
        print(output.text)
        print(f"[{output.finish_reason.value}: {len(output.token_ids)} tokens]", file=sys.stderr)
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from freetoken.demo import ensure_demo_model

    path = ensure_demo_model(args.dir, args.family)
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from freetoken.triton.launcher import serve

    return serve(engine_config_from_args(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text offline from one or more prompts")
    add_engine_flags(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.set_defaults(run=_generate)

    from freetoken.triton.launcher import add_serve_flags  # standard library only

    serve = commands.add_parser("serve", help="serve a model with Triton Inference Server (the demo model if no --model)")
    add_engine_flags(serve)
    add_serve_flags(serve)
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo-model", help="build the embedded tiny demo checkpoint (no downloads)")
    demo.add_argument("dir", nargs="?", default=None, help="where to write it (default: the cache)")
    demo.add_argument("--family", choices=["qwen3_5_moe", "qwen4_exp"], default="qwen3_5_moe")
    demo.set_defaults(run=_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
