"""``freetoken bench`` with some of issue 9's batch-1 switches turned off or on, for an A/B in one call:

    python benchmarks/b1_fusions_ab.py --off conv decode_norm greedy -- --preset qwen3.6-35b-a3b \\
        --batch-sizes 1 --max-running-requests 1 --input-len 1024 --output-len 32 --profile-steps 0
    python benchmarks/b1_fusions_ab.py --off decode_norm -- ...

``--off`` / ``--on`` name the switches to set False / True (none: the defaults); everything after
``--`` goes to ``freetoken bench`` unchanged. The folds (``conv``, ``decode_norm``, ``greedy``) and
the shared expert's gate/up in the MoE routing launch (``shared_route``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import replace

# name -> (module, its switch)
SWITCHES = {
    "conv": ("freetoken.layers.gated_deltanet", "FUSED_CONV"),
    "decode_norm": ("freetoken.layers.gated_deltanet", "FUSED_DECODE_NORM"),
    "greedy": ("freetoken.engine.sample", "FUSED_GREEDY"),
    "shared_route": ("freetoken.kernels.triton.moe_decode", "TILES.shared_in_route"),
}


def set_switch(module_name: str, switch: str, value: bool) -> None:
    """Set a module's switch, or with ``NAME.field`` a field of its frozen dataclass ``NAME``."""
    module = importlib.import_module(module_name)
    name, _, field = switch.partition(".")
    setattr(module, name, replace(getattr(module, name), **{field: value}) if field else value)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--off", nargs="*", default=[], choices=list(SWITCHES))
    parser.add_argument("--on", nargs="*", default=[], choices=list(SWITCHES))
    args = parser.parse_args(argv[:split])
    for names, value in ((args.off, False), (args.on, True)):
        for name in names:
            set_switch(*SWITCHES[name], value)
    print(f"off: {', '.join(args.off) or 'none'}; on: {', '.join(args.on) or 'none'}", flush=True)
    from freetoken.cli import main as cli

    return cli(["bench", *argv[split + 1 :]])


if __name__ == "__main__":
    sys.exit(main())
