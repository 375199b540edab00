"""What the W4A16 kernels compile to for the H200 (sm_90, Triton 3.6), without a GPU: registers,
spills, shared memory, and the SASS instruction mix per weight decoded, at the decode and prefill
tiles of Qwen3.6-35B-A3B's sizes. The stand-in driver of tests/kernels/compile_only.py compiles
every launch and runs none.

    PYTHONPATH=.venv/triton-3.6.0 .venv/bin/python benchmarks/nvfp4_sass.py [--dump DIR]

Per compiled kernel: ``cuobjdump --dump-resource-usage`` (REG, STACK, SHARED), the dynamic shared
memory, and counts of SASS instructions in the K loop (the body between the loop's label and its
backward branch, the part that runs once per weight tile) by class: tensor-core MMAs (HGMMA /
HMMA), shared-memory stores and loads (STS / LDS: layout conversions and operand staging), global
loads (LDG), integer ALU (IMAD, IADD3, LOP3, SHF, ISETP, SEL, PRMT...), conversions (F2F, I2F,
F2FP), float32 math (FMUL / FADD / FFMA / FSEL / FSETP), and that count over the weights the loop
body decodes per thread: the dequantization's cost in issue slots.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
import compile_only  # noqa: E402

compile_only.install(90)

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from freetoken.kernels.triton import nvfp4, nvfp4_decode  # noqa: E402

BF16 = torch.bfloat16
HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
CLASSES = {
    "mma": ("HGMMA", "HMMA"),
    "sts": ("STS",),
    "lds": ("LDS", "LDSM"),
    "ldg": ("LDG", "LDGSTS", "UTMALDG"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "PRMT", "LEA", "IABS", "IMNMX", "I2I", "BMSK", "LOP"),
    "cvt": ("F2F", "I2F", "F2FP", "F2I", "I2FP"),
    "fp32": ("FMUL", "FADD", "FFMA", "FSEL", "FSETP", "FMNMX"),
    "bar": ("BAR", "WARPGROUP", "DEPBAR", "SYNCS"),
}
compiled: list[tuple[str, dict, object]] = []
_run = JITFunction.run


def _recording_run(self, *args, **kwargs):
    kernel = _run(self, *args, **kwargs)
    config = {n: v for n, v in kwargs.items() if n.isupper() or n.startswith("num_")}
    compiled.append((self.fn.__name__, config, kernel))
    return kernel


JITFunction.run = _recording_run


def random_nvfp4(*shape: int):
    *lead, rows, cols = shape
    return (torch.zeros(*lead, rows, cols // 2, dtype=torch.uint8),
            torch.zeros(*lead, rows, cols // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.ones(*lead, rows))


# Stream variants of the decode block (nvfp4_decode_stream.py): rows a tile, warps.
STREAM_TILES = [
    dict(gate_up_per_sm=2, down_per_sm=2, gate_up_block_n=4, down_block_n=4, gate_up_warps=8, down_warps=4),
    dict(gate_up_per_sm=2, down_per_sm=2, gate_up_block_n=8, down_block_n=8, gate_up_warps=8, down_warps=8),
]


def cases():
    """(label, launch) at the sizes of benchmarks/nvfp4.py: decode B=1 / 64 and prefill 8k."""
    def block(t=1, tiles=nvfp4_decode.TILES):
        weights = (*random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(EXPERTS, HIDDEN, INTER),
                   *random_nvfp4(2 * INTER, HIDDEN), *random_nvfp4(HIDDEN, INTER))
        nvfp4_decode.sparse_moe_decode_nvfp4_tiled(torch.zeros(t, HIDDEN, dtype=BF16),
                                                   torch.zeros(t, EXPERTS + 1, dtype=BF16), *weights, TOP_K, True, tiles)

    yield "MoE block decode B=1 (sparse_moe_decode_nvfp4)", block
    for tiles in STREAM_TILES:
        yield f"MoE block decode B=1 stream {tiles}", lambda tiles=tiles: block(tiles=nvfp4_decode.NVFP4DecodeTiles(**tiles))
    for tokens, label in ((1, "decode B=1"), (64, "decode B=64"), (528, "prefix-hit tail 528"), (8192, "prefill 8k")):
        def experts(t=tokens):
            x = torch.zeros(t, HIDDEN, dtype=BF16)
            ids = torch.arange(t * TOP_K, dtype=torch.int32).remainder(EXPERTS).view(t, TOP_K)
            nvfp4.fused_experts_nvfp4(x, *random_nvfp4(EXPERTS, 2 * INTER, HIDDEN), *random_nvfp4(EXPERTS, HIDDEN, INTER),
                                      torch.full((t, TOP_K), 0.125, dtype=BF16), ids)

        def qkv(t=tokens):
            nvfp4.nvfp4_linear(torch.zeros(t, HIDDEN, dtype=BF16), *random_nvfp4(9216, HIDDEN))

        yield f"routed experts {label}", experts
        yield f"attention qkv {label}", qkv
    # The tuner's tail tiles (tune_nvfp4_moe.tail_candidates), gate/up and down side by side.
    from tune_nvfp4_moe import tail_candidates

    for gate_up, down in zip(tail_candidates("gate_up"), tail_candidates("down")):
        def tail(configs=(gate_up, down), t=528):
            x = torch.zeros(t, HIDDEN, dtype=BF16)
            ids = torch.arange(t * TOP_K, dtype=torch.int32).remainder(EXPERTS).view(t, TOP_K)
            nvfp4.fused_experts_nvfp4_tiled(x, *random_nvfp4(EXPERTS, 2 * INTER, HIDDEN),
                                            *random_nvfp4(EXPERTS, HIDDEN, INTER),
                                            torch.full((t, TOP_K), 0.125, dtype=BF16), ids, configs)

        kind = " split" if gate_up.split else " folded" if gate_up.fold_bias else ""
        yield f"tail 528 candidate{kind}", tail


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def loop_body(sass: str) -> list[str]:
    """The opcodes of the longest loop: from a backward branch's target to the branch."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INSTRUCTION.finditer(sass)]
    best: list[str] = []
    for i, (address, op, operands) in enumerate(code):
        target = re.match(r"\s*(0x[0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [o for a, o, _ in code[: i + 1] if a >= int(target.group(1), 16)]
            best = max(best, body, key=len)
    return best


def weights_per_thread(name: str, config: dict) -> float:
    """Weights one thread decodes per iteration of the K loop (gate/up decode two tiles; the decode
    block's gate/up those of ``PAIRS`` pairs, its down pass ``BLOCK_C`` choices' and the shared one's)."""
    down = name in ("_down_kernel", "_down_stream_kernel") and "BLOCK_C" in config
    rows = config["BLOCK_N"] * config.get("PAIRS", 1) * (config["BLOCK_C"] + 1 if down else 1)
    tiles = 2 if name == "_gate_up_stream_kernel" or (name == "_gate_up_kernel" and ("BLOCK_M" in config or "PAIRS" in config)) else 1
    return tiles * rows * config["BLOCK_K"] / (32 * config["num_warps"])


def report(label: str, dump: str | None) -> None:
    for name, config, kernel in compiled:
        if name not in ("_linear_kernel", "_gemv_kernel", "_gate_up_kernel", "_down_kernel", "_gate_up_stream_kernel",
                        "_down_stream_kernel"):
            continue
        resources, sass = compile_only.resources_and_sass(kernel)
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"{label.replace(' ', '_').replace('=', '')}_{name}.sass"), "w") as out:
                out.write(sass)
        body = Counter(loop_body(sass))
        counts = {cls: sum(body[op] for op in ops) for cls, ops in CLASSES.items()}
        total = sum(body.values())
        per_weight = total / weights_per_thread(name, config)
        tiles = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "FOLDED", "SPLIT", "num_warps", "num_stages") if k in config}
        mix = " ".join(f"{cls}={n}" for cls, n in counts.items())
        print(f"| {label} | {name} | {tiles} | {resources} | {kernel.metadata.shared} | {total} | {mix} | {per_weight:.2f} |")
    compiled.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", default=None, help="write each kernel's SASS to this folder")
    parser.add_argument("--only", nargs="+", default=None, help="cases whose label contains one of these")
    args = parser.parse_args()
    print("| case | kernel | tiles | resources | dynamic shared | loop instructions | by class | per weight per thread |")
    print("|---|---|---|---|---:|---:|---|---:|")
    for label, launch in cases():
        if args.only and not any(part in label for part in args.only):
            continue
        launch()
        report(label, args.dump)


if __name__ == "__main__":
    main()
