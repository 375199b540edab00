"""``freetoken generate``'s sampling flags: vLLM's ``SamplingParams`` names, each with its help and
default. The engine's ``--seed`` seeds the sampling (each prompt draws its seed from it), so one
command line gives the same text every time."""

from __future__ import annotations

import argparse

from freetoken.core import SamplingParams

_MODEL_DEFAULT = "default: the model's generation_config.json, else {}"


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)")
    group.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS or a stop may end it (default: 0)")
    group.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({_MODEL_DEFAULT.format(1.0)})")
    group.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass in (0, 1] ({_MODEL_DEFAULT.format(1.0)})")
    group.add_argument("--top-k", type=int, default=None, help=f"sample among the k likeliest; 0 or -1: all ({_MODEL_DEFAULT.format('all')})")
    group.add_argument("--min-p", type=float, default=None,
                       help=f"drop tokens below min-p x the likeliest's probability ({_MODEL_DEFAULT.format(0)})")
    group.add_argument("--repetition-penalty", type=float, default=None,
                       help=f"> 1 discourages tokens of the prompt and output ({_MODEL_DEFAULT.format(1.0)})")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted from tokens already in the output (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted once per earlier occurrence in the output (default: 0)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when the output contains TEXT, which is cut (repeatable; default: none)")
    group.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=int, default=None, metavar="ID",
                       help="stop at this token id (repeatable; default: none, EOS always stops)")
    group.add_argument("--include-stop-str-in-output", action="store_true",
                       help="keep the stop text that ended the output (default: cut it)")
    group.add_argument("--ignore-eos", action="store_true", help="go on past EOS until --max-tokens (default: stop at EOS)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The flags as ``SamplingParams``; raises ``ValueError`` naming a value out of range."""
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_ids,
        include_stop_str_in_output=args.include_stop_str_in_output,
    )
    params.validate()
    return params
