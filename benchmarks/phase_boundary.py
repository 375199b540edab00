"""What one dependent phase of a batch-1 decode step costs: a kernel boundary under programmatic
dependent launch, against a grid-wide barrier inside one persistent launch (issue 9).

A batch-1 step is about 300 dependent launches; each weight-streaming one runs at 58-72% of HBM and
the latency-bound ones cost their launch, so the step is 1.6x its floor (docs/benchmarks.md). The
step's next structure would be persistent kernels whose phases meet at grid barriers and which can
load the next phase's weights before the barrier. Whether that pays depends on two numbers this
script measures before anything is built: what a barrier costs against a PDL boundary, and how much
of a phase's weight stream the early loads hide.

It times a chain of ``--phases`` dependent GEMVs ``y <- W_i y`` (square, ``--rows`` x ``--rows`` bf16, 8 MB
each by default: a decode projection's size; the weights of all phases exceed L2, as a step's do),
captured in a CUDA graph, per phase:

- ``launches, PDL``: a launch a phase, each program loading its weight rows before waiting for the
  previous launch (as the engine's GEMVs do);
- ``launches``: the same without PDL;
- ``persistent, prefetch``: one launch, one program a row block (all resident), the phases separated by
  a grid barrier (an arrival counter a phase, an acquire spin), each program's rows of the next
  phase loaded between its arrival and its spin, so they stream while it waits;
- ``persistent``: the same with the rows loaded after the barrier;

and the same four with no weights (each phase reads the whole vector and writes its rows): the bare
cost of a boundary. Every variant's last vector is checked against a torch chain of the same
roundings.

    python benchmarks/phase_boundary.py [--phases 40] [--rows 2048] [--block-n 16] [--json FILE]

On the GPU only: the barrier needs every program resident at once. (The CPU test runs the kernels
under the interpreter with one program, where the barrier is trivially met.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us  # noqa: E402

from freetoken.kernels.triton._common import INTERPRETED  # noqa: E402

# The H200's measured copy bandwidth (docs/benchmarks.md), for the floor column.
HBM_BYTES_PER_S = 4.3e12


@triton.jit
def _phase(w_ptr, x, n, k, HAS_W: tl.constexpr, w=None):
    """This program's rows ``n`` of the next vector from the whole vector ``x`` (float32): ``W x``
    with the loaded weight tile ``w``, or with no weights ``x[n] / 2 + max(x) / 2`` (every element
    read; a maximum, so the torch chain's result is exact whatever the reduction order)."""
    if HAS_W:
        return tl.sum(w.to(tl.float32) * x[None, :], 1)
    mine = tl.sum(tl.where(k[None, :] == n[:, None], x[None, :], 0.0), 1)
    return mine * 0.5 + tl.max(x, 0) * 0.5


@triton.jit
def _launch_kernel(w_ptr, x_ptr, y_ptr, cols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_W: tl.constexpr,
                   PDL: tl.constexpr):
    """One phase as one launch: ``y[rows] = phase(x)``, the weight rows loaded before the PDL wait."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = None
    if HAS_W:
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * cols + k[None, :], mask=(k < cols)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + k, mask=k < cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, _phase(w_ptr, x, n, k, HAS_W, w).to(y_ptr.dtype.element_ty))


@triton.jit
def _persistent_kernel(w_ptr, buf_ptr, count_ptr, phases, rows, cols, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, HAS_W: tl.constexpr, PREFETCH: tl.constexpr):
    """Every phase in one launch: phase ``i`` reads ``buf[i]`` and writes this program's rows of
    ``buf[i + 1]``, then arrives at ``count[i]`` and spins until every program has. ``PREFETCH``:
    the next phase's weight rows are loaded between the arrival and the spin."""
    nprog = tl.num_programs(0)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * cols + k[None, :]
    k_ok = (k < cols)[None, :]
    phase_elems = rows.to(tl.int64) * cols
    w = tl.zeros([BLOCK_N, BLOCK_K], w_ptr.dtype.element_ty)
    if HAS_W and PREFETCH:
        w = tl.load(w_rows, mask=k_ok, other=0.0)
    for i in range(phases):
        if HAS_W and not PREFETCH:
            w = tl.load(w_rows + i * phase_elems, mask=k_ok, other=0.0)
        # .cg: the other programs wrote buf[i]; L1 may hold nothing of it, but must not be trusted
        x = tl.load(buf_ptr + i * cols + k, mask=k < cols, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = _phase(w_ptr, x, n, k, HAS_W, w)
        tl.store(buf_ptr + (i + 1) * cols + n, y.to(buf_ptr.dtype.element_ty))
        tl.debug_barrier()  # every thread's stores before the arrival's release
        tl.atomic_add(count_ptr + i, 1, sem="release", scope="gpu")
        # The next rows are loaded after the arrival: its release is a MEMBAR.GPU that waits for
        # every memory operation the thread has in flight, so loads issued before it would land
        # before the arrival instead of during the wait (session 33's version did that). The spin's
        # acquire loads (LDG.STRONG.GPU, CCTL.IVALL) leave them in flight.
        if HAS_W and PREFETCH:
            w = tl.load(w_rows + tl.minimum(i + 1, phases - 1) * phase_elems, mask=k_ok, other=0.0)
        arrived = 0
        while arrived < nprog:  # at least one acquire, the last arrival's too
            arrived = tl.atomic_add(count_ptr + i, 0, sem="acquire", scope="gpu")


def reference_phase(weights: torch.Tensor | None, x: torch.Tensor, i: int) -> torch.Tensor:
    """Phase ``i`` in torch with the kernels' roundings (float32 sums, the vector stored in ``x``'s dtype)."""
    xf = x.float()
    return (weights[i].float() @ xf if weights is not None else xf * 0.5 + xf.max() * 0.5).to(x.dtype)


def reference(weights: torch.Tensor | None, x0: torch.Tensor, phases: int) -> torch.Tensor:
    """The whole chain in torch (``reference_phase`` after ``reference_phase``)."""
    x = x0
    for i in range(phases):
        x = reference_phase(weights, x, i)
    return x


def run_launches(weights, buf, phases: int, block_n: int, pdl: bool) -> None:
    rows = buf.shape[1]
    has_w = weights is not None
    for i in range(phases):
        _launch_kernel[(rows // block_n,)](
            weights[i] if has_w else buf, buf[i], buf[i + 1], rows, BLOCK_N=block_n,
            BLOCK_K=triton.next_power_of_2(rows), HAS_W=has_w, PDL=pdl, num_warps=8, launch_pdl=pdl,
        )


def run_persistent(weights, buf, counts, phases: int, block_n: int, prefetch: bool) -> None:
    rows = buf.shape[1]
    counts.zero_()
    _persistent_kernel[(rows // block_n,)](
        weights if weights is not None else buf, buf, counts, phases, rows, rows, BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(rows), HAS_W=weights is not None, PREFETCH=prefetch, num_warps=8,
    )


def variants(block_n: int, pdl_ok: bool) -> dict:
    """name -> run(weights or None, buf, counts, phases)."""
    found = {
        "launches": lambda w, b, c, p: run_launches(w, b, p, block_n, False),
        "persistent": lambda w, b, c, p: run_persistent(w, b, c, p, block_n, False),
        "persistent, prefetch": lambda w, b, c, p: run_persistent(w, b, c, p, block_n, True),
    }
    if pdl_ok:
        found["launches, PDL"] = lambda w, b, c, p: run_launches(w, b, p, block_n, True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=int, default=40)
    parser.add_argument("--rows", type=int, default=2048, help="the vector's length (square weights)")
    parser.add_argument("--block-n", type=int, default=16, help="rows a program (2048 / 16: 128 programs)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if INTERPRETED or not torch.cuda.is_available():
        sys.exit("phase_boundary.py times on a GPU (the persistent barrier needs every program resident)")
    device, n = torch.device("cuda"), args.rows
    programs = n // args.block_n
    if programs > torch.cuda.get_device_properties(device).multi_processor_count:
        sys.exit(f"{programs} programs exceed the multiprocessors: the barrier needs one an SM")
    gen = torch.Generator(device=device).manual_seed(0)
    weights = torch.randn(args.phases, n, n, device=device, generator=gen).mul_(n**-0.5).to(torch.bfloat16)
    x0 = torch.randn(n, device=device, generator=gen).to(torch.bfloat16)
    buf = torch.empty(args.phases + 1, n, device=device, dtype=torch.bfloat16)
    counts = torch.zeros(args.phases, device=device, dtype=torch.int32)
    pdl_ok = torch.cuda.get_device_capability(device)[0] >= 9
    rows = []
    print(f"{args.phases} phases of {n} x {n} bf16 ({n * n * 2 / 1e6:.1f} MB a phase, floor "
          f"{n * n * 2 / HBM_BYTES_PER_S * 1e6:.2f} us at {HBM_BYTES_PER_S / 1e12:.1f} TB/s), {programs} programs")
    print(f"{'variant':<24} {'weights':>8} {'us/phase':>9} {'TB/s':>6} {'rel err':>8}")
    for has_w in (True, False):
        w = weights if has_w else None
        want = reference(w, x0, args.phases).float()
        for name, run in variants(args.block_n, pdl_ok).items():
            buf.fill_(float("nan"))
            buf[0] = x0
            us = graph_us(lambda: run(w, buf, counts, args.phases), calls=args.phases)
            got = buf[args.phases].float()
            err = ((got - want).norm() / want.norm()).item()
            tbs = n * n * 2 / (us * 1e-6) / 1e12 if has_w else float("nan")
            rows.append(dict(variant=name, weights=has_w, us_per_phase=us, tb_per_s=tbs, rel_err=err))
            print(f"{name:<24} {'yes' if has_w else 'no':>8} {us:>9.2f} {tbs:>6.2f} {err:>8.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(phases=args.phases, rows_per_program=args.block_n, size=n, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
