"""Compile benchmarks/gluon_down_gemm.py's kernel for sm_90 on a machine without a GPU (the stand-in driver of
tests/kernels/compile_only.py) and print registers, spills, shared memory, warps and the PTX/SASS
instructions that show the schedule.

    PYTHONPATH=.venv/triton-3.6.0 .venv/bin/python benchmarks/gluon_down_compile.py [--dump DIR]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
sys.path.insert(0, HERE)
import compile_only  # noqa: E402

compile_only.install(90)

import torch  # noqa: E402
import triton  # noqa: E402

import gluon_down_gemm as gluon_down  # noqa: E402



def report(name, kernel, dump=None):
    line, sass = compile_only.resources_and_sass(kernel)
    ptx = kernel.asm["ptx"]
    ptx_ops = {op: ptx.count(op) for op in ("wgmma.mma_async", "wgmma.wait_group", "cp.async.bulk.tensor",
                                            "mbarrier.try_wait", "mbarrier.arrive", "setmaxnreg", "bar.sync",
                                            "st.global")}
    sass_ops = {op: sass.count(op) for op in ("HGMMA", "UTMALDG", "SYNCS", "STL", "USETMAXREG", "STG.E.128")}
    maxnreg = [l.strip() for l in ptx.splitlines() if "setmaxnreg" in l]
    print(f"{name}: {line} | dynamic shared {kernel.metadata.shared} B | num_warps {kernel.metadata.num_warps}")
    print(f"    PTX {ptx_ops}\n    SASS {sass_ops}\n    setmaxnreg: {sorted(set(maxnreg))}")
    if dump:
        os.makedirs(dump, exist_ok=True)
        base = os.path.join(dump, name.replace(" ", "_").replace("/", "_"))
        open(base + ".ptx", "w").write(ptx)
        open(base + ".ttgir", "w").write(kernel.asm["ttgir"])
        open(base + ".sass", "w").write(sass)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", help="write each variant's PTX / TTGIR / SASS here")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    tokens, experts, hidden, inter = 8192, 256, 2048, 512
    pairs = tokens * 8
    bf16 = torch.bfloat16
    h = torch.zeros(pairs, inter, dtype=bf16)
    w2 = torch.zeros(experts, hidden, inter, dtype=bf16)
    y = torch.zeros(pairs, hidden, dtype=bf16)
    order = torch.zeros(pairs, dtype=torch.int32)
    weights = torch.zeros(pairs, dtype=bf16)
    map_tiles = pairs // 128 + experts
    tiles = torch.zeros(3 * map_tiles + 1, dtype=torch.int32)
    failed = 0
    for name, kw in gluon_down.VARIANTS:
        if args.only and not any(s in name for s in args.only):
            continue
        programs = 264 if kw.get("schedule") == "single" else 132
        if kw.get("schedule") == "single":
            kw = dict(kw, ctas_per_sm=2)
        try:
            kernel = gluon_down.launch(h, w2, order, weights, y, tiles, map_tiles, programs, **kw)
            report(name, kernel, args.dump)
        except Exception as exc:
            failed += 1
            msg = str(exc)
            print(f"{name}: FAILED {type(exc).__name__}: {msg[-3000:]}")
    print(f"triton {triton.__version__}: {failed} failed")


if __name__ == "__main__":
    main()
