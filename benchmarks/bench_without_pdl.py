"""``freetoken`` with every Triton kernel launched without programmatic dependent launch (PDL).

Under PDL a kernel starts while its predecessor finishes and waits on the device, so a profile's
kernel times include that wait and sum to more than the busy step. Without PDL each kernel's time
is its own, which is what a per-kernel comparison with its bytes needs (issue 9):

    python benchmarks/bench_without_pdl.py bench --preset qwen3.6-35b-a3b --batch-sizes 1 \\
        --max-running-requests 1 --input-len 1024 --output-len 32 --profile-steps 5

Arguments go to ``freetoken.cli``. Kernels compiled with ``PDL=True`` then run their grid
dependency instructions as no-ops, since the launch carries no PDL attribute.
"""

from __future__ import annotations

import sys

import triton.runtime.jit as jit

_run = jit.JITFunction.run


def _run_without_pdl(self, *args, **kwargs):
    if "launch_pdl" in kwargs:
        kwargs["launch_pdl"] = False
    return _run(self, *args, **kwargs)


if __name__ == "__main__":
    jit.JITFunction.run = _run_without_pdl
    from freetoken.cli import main

    sys.exit(main(sys.argv[1:]))
