"""Tile configurations of the MoE grouped GEMMs, per GEMM and expert shape, chosen by the mean
number of (token, choice) pairs per expert.

``TUNED`` holds what ``benchmarks/tune_moe.py`` measured on the H200 (it prints entries in this
format); shapes it does not list use ``DEFAULT``. A table instead of autotuning: start-up pays
no tuning run, and a launch chooses its tiles from host-side sizes only (no device sync).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, fields, replace

import torch

from freetoken.kernels.triton._common import INTERPRETED


@dataclass(frozen=True)
class GemmConfig:
    """One grouped-GEMM launch: tile sizes, ``group_m`` row tiles run together over all column
    blocks (so a weight block is reused from L2 by them), warps and software-pipelining depth.

    ``persistent``: 0 launches one program per (row tile, column block); ``p > 0`` launches ``p``
    programs per SM, each looping over tiles (``moe._gate_up_persistent_kernel``,
    ``_down_persistent_kernel``): the expert offsets are read and summed once per program instead
    of once per tile, and no program starts for the row tiles past the real count. (The tile loop
    pipelined with the K loop as one, one program an SM, was slower on the H200: docs/benchmarks.md,
    issue 10.)"""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    _: KW_ONLY  # the persistent launches' fields, by keyword (subclasses add positional fields)
    persistent: int = 0
    # Persistent launches: operands read by TMA, the down GEMM's ``h`` rows and weight rows
    # (``moe._down_block_tma``), the gate/up GEMM's weight rows (its ``x`` rows are gathered by
    # token: pointer loads; ``moe._gate_up_block_tma``).
    tma: bool = False
    # The persistent launches' register cap (ptxas .maxnreg; 0: the compiler's choice). 128 fits two
    # 8-warp programs an SM: the 128 x 128 x 64 down GEMM compiles there without spills.
    max_registers: int = 0
    # Persistent launches: an expert's last row tile holding at most ``block_m // 2`` pairs runs as
    # a ``block_m // 2``-row tile (half the MMA work and half its ``h`` / ``x`` rows). At ~256
    # pairs an expert (T=8192, uniform routing) 128-row tiles number ~642 against 512 full ones, and
    # half of the partial ones hold at most 64 pairs.
    half_tail: bool = False
    # Persistent launches: each row tile's (expert, first pair, end) read from a map one small
    # launch writes (``moe.tile_map``) instead of reduced from all experts' offsets by every tile
    # (three reductions across the warps a tile, each with a barrier).
    tile_map: bool = False

    def __post_init__(self) -> None:
        if (self.tma or self.max_registers or self.half_tail or self.tile_map) and not self.persistent:
            raise ValueError(
                f"GemmConfig.tma / max_registers / half_tail / tile_map need persistent > 0, got {self}"
            )
        if self.half_tail and self.block_m < 32:
            raise ValueError(f"GemmConfig.half_tail needs block_m >= 32 (a dot takes 16 rows or more), got {self}")


C = GemmConfig


def config_source(config: GemmConfig) -> str:
    """``config`` spelled as the tables spell it: ``C(positional fields, keyword=...)``, the
    keyword-only fields only where they differ from their defaults."""
    parts = []
    for f in fields(config):
        value = getattr(config, f.name)
        if not f.kw_only:
            parts.append(repr(value))
        elif value != f.default:
            parts.append(f"{f.name}={value!r}")
    return f"C({', '.join(parts)})"
# (largest mean pairs per expert, config), increasing; the last bucket has no upper bound.
Buckets = tuple[tuple[float, GemmConfig], ...]

DEFAULT: dict[str, Buckets] = {
    # gate/up: each program computes a gate block and the matching up block (2 x block_n columns).
    "gate_up": (
        (16, C(16, 64, 64, 1, 4, 3)),
        (48, C(32, 64, 64, 1, 4, 3)),
        (96, C(64, 64, 64, 4, 4, 3)),
        (float("inf"), C(128, 64, 64, 8, 8, 3)),
    ),
    "down": (
        (16, C(16, 64, 64, 1, 4, 3)),
        (48, C(32, 64, 64, 1, 4, 3)),
        (96, C(64, 128, 64, 4, 4, 3)),
        (float("inf"), C(128, 128, 64, 8, 8, 3)),
    ),
}

# (gemm, hidden, intermediate, experts) -> buckets, bf16, measured on the H200
# (`benchmarks/tune_moe.py --tokens 4096 8192 --quick`, docs/benchmarks.md run 6; the 16-48 bucket from
# `--tokens 640 8192 --quick`, the 512-token tail of a prefix-cache hit); the 48-96 bucket is DEFAULT's.
TUNED: dict[tuple[str, int, int, int], Buckets] = {
    ("gate_up", 2048, 512, 256): (
        (16, C(16, 64, 64, 1, 4, 3)),
        (48, C(32, 64, 128, 8, 4, 3)),  # T=640: 260 us (its 1.07 GB of weights: at the HBM floor)
        (96, C(64, 64, 64, 4, 4, 3)),
        (181, C(128, 64, 64, 8, 8, 3)),  # T=4096: 411 us, 334 TFLOP/s
        # T=8192: 593.3 us, 463.3 TFLOP/s, 128-wide tiles by TMA at one program an SM (the earlier
        # 64-wide two-programs-an-SM entry 624.8 us in the same run; benchmarks/prefill_sweep.py)
        (float("inf"), C(128, 128, 64, 8, 8, 4, persistent=1, tma=True)),
    ),
    ("down", 2048, 512, 256): (
        (16, C(16, 64, 64, 1, 4, 3)),
        (48, C(32, 128, 64, 8, 4, 3)),  # T=640: 146 us (537 MB of weights: 1.17x the HBM floor)
        (96, C(64, 128, 64, 4, 4, 3)),
        (181, C(128, 128, 64, 8, 8, 3)),  # T=4096: 255 us, 270 TFLOP/s
        # T=8192: 341.1 us, 402.9 TFLOP/s, 4 warps and the half-size tail tiles (the earlier 8-warp
        # entry without them 372.2 us in the same run; benchmarks/prefill_sweep.py); the row tiles
        # from the map: 335.8 against 339.0 us in one H200 run, 381.5 against 384.3 on an H100
        (float("inf"), C(128, 128, 64, 8, 4, 3, persistent=2, tma=True, half_tail=True, tile_map=True)),
    ),
}

# The T=8192 tiles the options are stacked on (benchmarks/prefill_sweep.py's candidates,
# tests/gpu/test_prefill_options_gpu.py): the table's winners take options that do not fit them (two
# programs an SM of the 4-stage 128-wide gate/up tile, a 256-wide one at 4 stages).
OPTION_BASE = {"gate_up": C(128, 64, 64, 8, 8, 3), "down": C(128, 128, 64, 8, 8, 3)}


def moe_gemm_config(
    gemm: str, dtype: torch.dtype, num_pairs: int, num_experts: int, hidden: int, inter: int
) -> GemmConfig:
    """The configuration of ``gemm`` (``"gate_up"`` or ``"down"``) for this launch."""
    mean_rows = num_pairs / max(num_experts, 1)
    buckets = TUNED.get((gemm, hidden, inter, num_experts), DEFAULT[gemm])
    return fit_to_dtype(next(c for bound, c in buckets if mean_rows <= bound), dtype)


def fit_to_dtype(config: GemmConfig, dtype: torch.dtype) -> GemmConfig:
    """``config`` as it runs for ``dtype`` (and under the interpreter): the tables hold bf16 tiles."""
    if INTERPRETED:  # few, large programs: the interpreter's cost is per program and operation
        return replace(config, block_m=min(config.block_m, 64), block_n=128, block_k=256, num_stages=1)
    if dtype == torch.float32:  # float32 tiles are narrower to fit shared memory
        return replace(config, block_m=min(config.block_m, 64), block_n=64, block_k=32, num_warps=4, num_stages=2)
    return config
