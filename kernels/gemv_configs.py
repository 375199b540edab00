"""Launch shapes of the few-row GEMV (``kernels/triton/gemv.py``) per weight shape and row count,
and where cuBLAS is kept instead.

``TUNED`` holds what ``benchmarks/gemv_sweep.py`` measured on the H200 (it prints entries in this
format); shapes it does not list use ``default_config``. A table instead of autotuning: start-up pays
no tuning run, and a launch chooses its shape from host-side sizes only (no device sync, capture-safe).
Plain Python (no Triton import): ``layers.linear`` consults it on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

# Up to this many activation rows the GEMV may replace cuBLAS (one program holds all of them; the
# weights are read once whatever the row count, the FMAs grow with it).
GEMV_MAX_ROWS = 8
# For shapes the table does not list, up to this many: at 8 rows the FMA kernel's instructions (about
# 1.2 a weight a row in SASS, plus the activation loads) come near its weight stream's time at the
# H200's bandwidth, so only the sweep's measurement moves a shape past 4.
UNTUNED_MAX_ROWS = 4
# The H200's SMs: the default shape aims at a few programs on each.
NUM_SMS = 132
# Weights of at least this many elements stay with cuBLAS unless the table lists them: its GEMV
# streams the 248320 x 2048 lm_head at ~4.1 TB/s already (docs/benchmarks.md); the loss is at the
# 1-50 MB projections, where its kernels ramp up and drain.
CUBLAS_MIN_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class GemvConfig:
    """One launch: ``block_n`` weight rows a program, streamed ``block_k`` columns a step (for 2-byte
    weights: 16 bytes a thread at 8 per thread; float32 weights take half as many columns, the same
    bytes), ``num_warps``, ``num_stages`` (software pipelining of the K loop), and ``pdl``:
    programmatic dependent launch where the GPU has it (sm_90 on): the programs start while the
    previous launch ends and load their first weight step before waiting for it. ``dot``: the
    tensor-core variant for 2-byte weights (``W tile @ x.T``, the rows padded to 16, the K loop
    pipelined through shared memory over ``num_stages``; needs ``block_n >= 16``); float32 weights
    take the FMA kernel whatever it says."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    pdl: bool = True
    dot: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages must be at least 1, got {self.num_stages}")
        if self.dot and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"GemvConfig.dot needs block_n and block_k >= 16, got {self.block_n}, {self.block_k}")

    def label(self) -> str:
        return (f"{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{' dot' if self.dot else ''}"
                f"{' pdl' if self.pdl else ''}")


C = GemvConfig
# (largest row count, config or None where cuBLAS is faster), increasing; rows past the last bound
# (and past GEMV_MAX_ROWS) stay with cuBLAS.
Buckets = tuple[tuple[int, GemvConfig | None], ...]

# (out, in) -> buckets, bf16, measured on the H200 by benchmarks/gemv_sweep.py.
# `python3 benchmarks/gemv_sweep.py` on the H200 (torch 2.11, Triton 3.6), graph replays of distinct
# weight copies: at one row the step's GEMVs 1,325.5 us (cuBLAS) -> 1,082.8 us (docs/benchmarks.md).
# The router + shared-gate weight is (257, 2048) padded to (264, 2048) rows (layers.moe); the sweep
# measured it at 257 rows, before the padding.
TUNED: dict[tuple[int, int], Buckets] = {
    (12352, 2048): ((1, C(1, 2048, 1, 1, False)), (2, C(64, 128, 4, 3, True, dot=True)), (4, C(64, 128, 4, 3, True, dot=True)), (8, C(64, 128, 4, 3, True, dot=True))),  # in_proj
    (2048, 4096): ((1, C(1, 2048, 1, 1, True)), (2, C(8, 2048, 8, 1, True)), (4, C(16, 256, 4, 4, False, dot=True)), (8, C(16, 256, 4, 4, False, dot=True))),  # out_proj
    (264, 2048): ((1, C(1, 2048, 1, 1, True)), (2, C(1, 2048, 1, 1, True)), (4, C(4, 2048, 4, 1, False)), (8, C(4, 2048, 4, 1, False))),  # router
    (9216, 2048): ((1, C(2, 2048, 2, 1, True)), (2, C(16, 512, 4, 1, True)), (4, None), (8, None)),  # qkv
    (248320, 2048): ((1, C(4, 2048, 4, 1, True)), (2, C(8, 1024, 8, 1, True)), (4, C(64, 128, 4, 3, True, dot=True)), (8, C(64, 128, 4, 3, True, dot=True))),  # lm_head
}


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def default_config(n_out: int, k_in: int) -> GemvConfig:
    """Whole 2048-column row steps (4 KB a row), one row a warp (64 weights a thread), and rows
    enough per program for about four programs an SM, at least one row."""
    block_n = next((b for b in (8, 4, 2) if -(-n_out // b) >= 4 * NUM_SMS), 1)
    return GemvConfig(block_n, min(2048, _pow2(k_in)), block_n)


def _tuned(num_rows: int, n_out: int, k_in: int) -> tuple[bool, GemvConfig | None]:
    """(whether the table lists the shape, its entry for ``num_rows``: None where cuBLAS wins)."""
    buckets = TUNED.get((n_out, k_in))
    if buckets is None:
        return False, None
    return True, next((c for bound, c in buckets if num_rows <= bound), None)


def prefers_gemv(num_rows: int, n_out: int, k_in: int) -> bool:
    """Whether ``x [num_rows, k_in] @ W.T`` (``W [n_out, k_in]``) should run as the GEMV: up to
    ``GEMV_MAX_ROWS`` rows where the sweep measured the shape and found the GEMV faster; for a shape
    it did not measure, up to ``UNTUNED_MAX_ROWS`` rows unless the weight is as large as an lm_head."""
    if not 0 < num_rows <= GEMV_MAX_ROWS:
        return False
    listed, config = _tuned(num_rows, n_out, k_in)
    if listed:
        return config is not None
    return num_rows <= UNTUNED_MAX_ROWS and n_out * k_in < CUBLAS_MIN_ELEMENTS


def gemv_config(num_rows: int, n_out: int, k_in: int) -> GemvConfig:
    """The launch shape for this call: the table's, else ``default_config`` (also where the table
    keeps cuBLAS, for a caller that asked for the GEMV anyway)."""
    return _tuned(num_rows, n_out, k_in)[1] or default_config(n_out, k_in)


# The GEMV with the residual add + RMSNorm in its prologue (``kernels/normed_gemv.py``): up to this
# many rows, all in one program (each program normalizes every row itself).
NORMED_MAX_ROWS = 4
# (out, in) -> buckets of the fused kernel (FMA only; ``dot`` entries are not taken), measured by
# ``benchmarks/normed_gemv_sweep.py``; a shape or row count it does not list takes the GEMV's own
# entry where that is an FMA one, else ``default_config``. ``None``: the norm and GEMV stay apart.
# `python3 benchmarks/normed_gemv_sweep.py --shapes in_proj` / `--shapes qkv` on the H200: at one row
# norm + GEMV 15.07 -> 13.39 us (GDN in_proj) and 11.99 -> 10.68 us (attention qkv); `--shapes router
# lm_head`: router 2.39 -> 1.74 us, lm_head 221.0 -> 219.4 us.
NORMED_TUNED: dict[tuple[int, int], Buckets] = {
    (12352, 2048): ((1, C(16, 1024, 4, 1, True)),),  # GDN in_proj
    (9216, 2048): ((1, C(8, 2048, 4, 1, True)),),  # attention qkv
    (264, 2048): ((1, C(4, 2048, 4, 1, True)),),  # router + shared-expert gate
    (248320, 2048): ((1, C(8, 1024, 2, 1, True)),),  # lm_head
}


def prefers_normed_gemv(num_rows: int, n_out: int, k_in: int) -> bool:
    """Whether ``linear(norm(x + residual), W)`` should run as one fused launch: where the GEMV runs
    (``prefers_gemv``), up to ``NORMED_MAX_ROWS`` rows, unless the fused sweep measured it slower."""
    if not (num_rows <= NORMED_MAX_ROWS and prefers_gemv(num_rows, n_out, k_in)):
        return False
    for bound, config in NORMED_TUNED.get((n_out, k_in), ()):
        if num_rows <= bound:
            return config is not None
    return True  # a row count the fused table does not list: the GEMV's entry (``normed_gemv_config``)


def normed_gemv_config(num_rows: int, n_out: int, k_in: int) -> GemvConfig:
    """The fused launch's shape: the fused table's, else the GEMV's FMA entry, else ``default_config``."""
    buckets = NORMED_TUNED.get((n_out, k_in), ())
    config = next((c for bound, c in buckets if num_rows <= bound), None)
    if config is None:
        config = _tuned(num_rows, n_out, k_in)[1]
    if config is None or config.dot:
        config = default_config(n_out, k_in)
    return config
