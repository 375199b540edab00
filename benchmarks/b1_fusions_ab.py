"""``freetoken bench`` with some of issue 9's batch-1 folds switched off, for an A/B in one call:

    python benchmarks/b1_fusions_ab.py --off route conv gated greedy -- --preset qwen3.6-35b-a3b \\
        --batch-sizes 1 --max-running-requests 1 --input-len 1024 --output-len 32 --profile-steps 0

``--off`` names the folds to turn off (none: the defaults, all on); everything after ``--`` goes to
``freetoken bench`` unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# fold -> (module, its switch)
FOLDS = {
    "route": ("freetoken.layers.moe", "FUSED_ROUTE"),
    "conv": ("freetoken.layers.gated_deltanet", "FUSED_CONV"),
    "gated": ("freetoken.layers.gated_deltanet", "FUSED_OUTPUT_NORM"),
    "decode_norm": ("freetoken.layers.gated_deltanet", "FUSED_DECODE_NORM"),
    "greedy": ("freetoken.engine.sample", "FUSED_GREEDY"),
}


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--off", nargs="*", default=[], choices=list(FOLDS))
    args = parser.parse_args(argv[:split])
    for fold in args.off:
        module, switch = FOLDS[fold]
        setattr(importlib.import_module(module), switch, False)
    print(f"folds off: {', '.join(args.off) or 'none'}", flush=True)
    from freetoken.cli import main as cli

    return cli(["bench", *argv[split + 1 :]])


if __name__ == "__main__":
    sys.exit(main())
