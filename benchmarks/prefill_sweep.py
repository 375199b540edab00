"""Issue 10's kernel sub-targets on one GPU, each option against today's default, and the table
entries to apply (one call, ~1 min with cold Triton caches):

    python3 benchmarks/prefill_sweep.py [--only moe attention] [--gemm gate_up down]

- MoE grouped GEMMs at T=8192 (256 experts of 2048 x 512, top-8; target 450 TFLOP/s each): the
  table's tiles against persistent launches (``GemmConfig.persistent``: two programs an SM at 128
  registers), TMA operands (``tma``), the half-size tail tile (``half_tail``) and 256-wide output
  tiles at one program an SM, and the table's tile with the half-size tail tiles and the row
  tiles read from a map (``tile_map``) (``moe_candidates``); prints the ``TUNED`` bucket to paste
  into ``moe_configs.py``. Then the next norm's pass over the down GEMM's output
  (``moe_combine_add_rms_norm``), the rest of the layer's MoE time at prefill.
- The peer in the same run: each MoE GEMM through ``torch._grouped_mm`` (CUTLASS's warp-specialized
  TMA grouped GEMM on sm_90, what PyTorch ships for MoE layers), fed and compared as ours
  (``grouped_mm_peer``).
- Attention prefill at 8k tokens, head_dim 128 (target 350 TFLOP/s) and 256: the default tiles,
  capped at 128 registers (two programs an SM, ``PREFILL_MAX_REGISTERS``), and at 128-key tiles.

GDN prefill (target 70 TFLOP/s at 32k tokens) is timed by ``bench_prefill.py --only gdn``; the
options measured here in session 21 and dropped are in docs/benchmarks.md (issue 10).

Times are medians of ``triton.testing.do_bench``; every option's output is compared with the
default's (relative L2 difference; the tests against the torch references are tests/kernels and
tests/gpu). FLOP counts as ``bench_prefill.py`` and ``tune_moe.py`` count them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefill import HKV, HQ, attention_flops, attention_inputs, rel_diff  # noqa: E402

from freetoken.kernels.triton import attention, moe  # noqa: E402
from freetoken.kernels.triton.moe_configs import OPTION_BASE, GemmConfig, config_source, moe_gemm_config  # noqa: E402

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def median_us(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


@contextlib.contextmanager
def patched(module, **values):
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def compare(case: str, flops: int, variants: dict, run, output) -> tuple[str, float] | None:
    """Times ``run`` under every variant (``{name: context manager factory}``; the first is the
    default), compares ``output()`` after a run with the default's, prints a row each, returns the
    fastest agreeing variant (name, us)."""
    reference, best = None, None
    for name, context in variants.items():
        try:
            with context():
                run()
                out = output()
                us = median_us(run)
        except Exception as exc:  # does not fit this GPU (shared memory, registers)
            print(f"| {case} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |", flush=True)
            continue
        reference = out if reference is None else reference
        diff = rel_diff(out, reference)
        print(f"| {case} | {name} | {us:.1f} | {flops / us / 1e6:.1f} | {diff:.1e} |", flush=True)
        if diff < 2e-2 and (best is None or us < best[1]):
            best = (name, us)
    return best


def moe_candidates(gemm: str, table: GemmConfig) -> list[GemmConfig]:
    """The table's tile, then the options on ``OPTION_BASE``'s tile (each compiles without spills on
    sm_90 unless noted): TMA operands (the down GEMM's ``h`` and weight rows; the gate/up GEMM's
    weight rows), the half-size tail tile (``half_tail``); two 4-warp programs an SM, each a whole
    128-row tile in one warp group (the other program's MMA runs under one's epilogue, as CUTLASS's
    ping-pong schedule), for the down GEMM also three at 2 stages and 168 registers; and a 256-wide
    output tile (gate/up: 128 gate + 128 up columns; down: 256) at one 8-warp program an SM (its
    128 x 256 float32 accumulator takes 128 registers a thread), 3 and 4 stages. On the table's tile
    itself some of them cannot run (two programs an SM of its 4-stage gate/up tile, say)."""
    base = OPTION_BASE[gemm]
    two = replace(base, persistent=2, max_registers=128)  # two 8-warp programs an SM, 128 registers
    pingpong = replace(two, num_warps=4, max_registers=0, tma=True)
    wide = replace(base, block_n=2 * base.block_n if gemm == "gate_up" else 256, persistent=1, max_registers=0,
                   tma=True)
    configs = [table, two]
    for option in (replace(two, tma=True), pingpong, wide):
        configs += [option, replace(option, half_tail=True)]
    configs += [replace(two, half_tail=True), replace(wide, num_stages=4)]  # 4 stages: 192 KB
    if gemm == "down":  # gate/up's spills at 168 registers
        three = replace(pingpong, persistent=3, num_stages=2, max_registers=168)
        configs += [three, replace(three, half_tail=True)]  # half_tail: 24 bytes of spills
    if table.persistent:  # the table's tile with the half-size tail tiles and the tile map
        configs += [replace(table, **options) for options in (
            dict(half_tail=True), dict(tile_map=True), dict(half_tail=True, tile_map=True))]
    return list(dict.fromkeys(configs))  # the table's may be one of them


def moe_sweep(tokens: int = 8192, gemms: tuple[str, ...] = ("gate_up", "down")) -> list[str]:
    experts, top_k, hidden, inter = 256, 8, 2048, 512
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=BF16, device=CUDA, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=BF16, device=CUDA, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, dtype=BF16, device=CUDA, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, dtype=BF16, device=CUDA, generator=gen)
    weights, ids = moe.moe_topk_softmax(logits, top_k, True)
    order, offsets = moe.moe_sort_tokens(ids, experts)
    pairs = tokens * top_k
    h = torch.randn(pairs, inter, dtype=BF16, device=CUDA, generator=gen)
    h_out, y = torch.empty_like(h), torch.empty(pairs, hidden, dtype=BF16, device=CUDA)
    entries = []
    for gemm in gemms:
        table = moe_gemm_config(gemm, BF16, pairs, experts, hidden, inter)
        configs = moe_candidates(gemm, table)
        launch = {
            "gate_up": lambda c: moe.gate_up(x, w13, order, offsets, h_out, top_k, c),
            "down": lambda c: moe.down(h, w2, order, offsets, weights, y, c),
        }[gemm]
        result = h_out if gemm == "gate_up" else y
        flops = 2 * pairs * (2 if gemm == "gate_up" else 1) * inter * hidden
        state = {}

        def variant(config):
            @contextlib.contextmanager
            def use():
                state["config"] = config
                yield
            return use

        variants = {("table " if c == table else "") + config_source(c): variant(c) for c in configs}
        best = compare(f"MoE {gemm} T={tokens}", flops, variants, lambda: launch(state["config"]), result.float)
        launch(table)
        grouped_mm_peer(gemm, tokens, flops, x, w13, w2, h, order, offsets, weights, result)
        if best:
            entries.append(f'moe_configs.TUNED[("{gemm}", {hidden}, {inter}, {experts})] last bucket: '
                           f'(float("inf"), {best[0].removeprefix("table ")}),  # T={tokens}: {best[1]:.0f} us, '
                           f'{flops / best[1] / 1e6:.0f} TFLOP/s')
        torch.cuda.empty_cache()
    if "down" in gemms:
        combine_row(tokens, top_k, hidden, y.view(tokens, top_k, hidden))
    return entries


def grouped_mm_peer(gemm: str, tokens: int, flops: int, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    h: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                    reference: torch.Tensor) -> None:
    """``gemm`` through ``torch._grouped_mm`` on the same sorted pairs, compared with ``reference``
    (the table's output). Gate/up: the pairs' token rows gathered first (our kernel reads them in
    place), the GEMM, then SiLU-and-mul (our epilogue): the GEMM alone and all three are timed.
    Down: the GEMM alone, its rows (sorted pairs) weighted and put in pair order untimed, which a
    combine reading the pairs through the sort could do on the way."""
    if not hasattr(torch, "_grouped_mm"):
        print(f"| MoE {gemm} T={tokens} | torch._grouped_mm | not in this torch | | |", flush=True)
        return
    ends, pairs = offsets[1:], order.long()
    top_k = pairs.numel() // tokens
    if gemm == "gate_up":
        w, token_of_pair = w13.transpose(1, 2), pairs // top_k
        rows = x[token_of_pair]
        whole = "torch._grouped_mm (CUTLASS), gather + GEMM + SiLU-and-mul"
        runs = {"torch._grouped_mm (CUTLASS), the GEMM alone": lambda: torch._grouped_mm(rows, w, offs=ends),
                whole: lambda: moe.silu_and_mul(torch._grouped_mm(x[token_of_pair], w, offs=ends))}
        out = runs[whole]()
    else:
        w = w2.transpose(1, 2)
        runs = {"torch._grouped_mm (CUTLASS)": lambda: torch._grouped_mm(h, w, offs=ends)}
        sorted_out = runs["torch._grouped_mm (CUTLASS)"]()
        out = torch.empty_like(reference)
        out[pairs] = (sorted_out.float() * weights.reshape(-1)[pairs, None].float()).to(out.dtype)
    diff = rel_diff(out, reference)
    for name, run in runs.items():
        us = median_us(run)
        print(f"| MoE {gemm} T={tokens} | {name} | {us:.1f} | {flops / us / 1e6:.1f} | {diff:.1e} |", flush=True)


def combine_row(tokens: int, top_k: int, hidden: int, pairs: torch.Tensor) -> None:
    """The rest of the layer's MoE output at prefill (``layers.moe.COMBINE_IN_NEXT_NORM``): the next
    norm sums the down GEMM's ``[T, k, H]`` pair outputs (``moe_combine_add_rms_norm``; not
    ``sum_choices``, which only the unpartitioned ``fused_experts`` runs), one more pass over them."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    shared = torch.randn(tokens, hidden, dtype=BF16, device=CUDA, generator=gen)
    residual = torch.randn(tokens, hidden, dtype=BF16, device=CUDA, generator=gen)
    gate = torch.randn(tokens, 1, dtype=BF16, device=CUDA, generator=gen)
    weight = torch.randn(hidden, dtype=BF16, device=CUDA, generator=gen)
    us = median_us(lambda: moe.moe_combine_add_rms_norm(pairs, shared, gate, residual, weight, 1e-6, True))
    moved = (pairs.numel() + 4 * shared.numel()) * pairs.element_size()  # pairs, shared, residual, 2 outputs
    print(f"| MoE combine + norm T={tokens} (reads the pairs) | moe_combine_add_rms_norm | {us:.1f} | "
          f"{moved / us / 1e6:.2f} TB/s | |", flush=True)
    torch.cuda.empty_cache()


def attention_sweep(length: int = 8192) -> list[str]:
    entries = []
    for head_dim in (128, 256):
        args, gate = attention_inputs(length, head_dim)
        default = attention._tile_sizes(BF16, head_dim, HQ // HKV, length)

        def tiles(config, registers=0):
            return lambda: patched(attention, _tile_sizes=lambda *a: config, PREFILL_MAX_REGISTERS=registers)

        variants = {f"tiles {default}": tiles(default)}
        if head_dim <= 128:
            variants[f"tiles {default} 128 registers"] = tiles(default, 128)
            for config in ((128, 128, 8, 2), (128, 128, 8, 3)):
                variants[f"tiles {config}"] = tiles(config)
        flops = attention_flops(length, head_dim)
        result = {}

        def run():
            result["out"] = attention.paged_attention(*args, gate=gate)

        best = compare(f"attention {length} d{head_dim}", flops, variants, run, lambda: result["out"].float())
        if best:
            entries.append(f"attention d{head_dim}: best {best[0]} ({best[1]:.0f} us, {flops / best[1] / 1e6:.0f} "
                           f"TFLOP/s): _tile_sizes -> "
                           f"{best[0].split(' ', 1)[1].removesuffix(' 128 registers')}; PREFILL_MAX_REGISTERS = "
                           f"{128 if best[0].endswith('128 registers') else 0}")
        torch.cuda.empty_cache()
    return entries


SWEEPS = {"moe": moe_sweep, "attention": attention_sweep}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    parser.add_argument("--gemm", nargs="+", choices=["gate_up", "down"], default=["gate_up", "down"],
                        help="the MoE GEMMs to sweep (one each keeps a call under ~90 s with cold caches)")
    args = parser.parse_args()
    print("| case | variant | us | TFLOP/s | rel. diff to default |")
    print("|---|---|---:|---:|---:|")
    entries = []
    for name in args.only:
        entries += SWEEPS[name](gemms=tuple(args.gemm)) if name == "moe" else SWEEPS[name]()
    print("\n# to apply (only where the best is not the default):")
    for line in entries:
        print(line)


if __name__ == "__main__":
    main()
