"""The MoE prefill GEMMs (gate/up, down) at the Qwen3.6-35B-A3B shape, called three times, for a
stall profile under Nsight Compute (the first call compiles; profile a later one):

    ncu --kernel-name regex:"(_down|_gate_up)" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 benchmarks/moe_prefill_ncu.py [--tokens 8192]
    ncu --kernel-name regex:_down --launch-skip 1 --launch-count 1 --section SourceCounters \\
        --page source --print-source sass --csv python3 benchmarks/moe_prefill_ncu.py

The inputs are ``bench_prefill.moe_case``'s (random bf16 weights, softmax top-8 routing).
"""

from __future__ import annotations

import argparse

import torch

import bench_prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    variants, _, _, _ = bench_prefill.moe_case(args.tokens)
    for _ in range(args.calls):
        variants["new"]()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
