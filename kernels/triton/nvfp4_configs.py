"""Launch configurations of the NVFP4 (W4A16) prefill GEMMs: the grouped MoE GEMMs' tiles per
GEMM and expert shape, chosen by the mean (token, choice) pairs per expert, and the sizes past which
a GEMM dequantizes its weights to the activation dtype and runs the bf16 GEMM instead.

Why buckets by pairs per expert: every row tile decodes its expert's whole weight tile in registers,
so at a prefix hit's tail (8-64 pairs an expert) one row tile an expert (``block_m`` >= the pairs)
decodes each weight once and the GEMM is bound by the packed bytes; at an 8k prefill (256 pairs an
expert) the decode is repeated per row tile and wide row tiles (or dequantizing once, ``dequant``)
pay it fewer times.

``TUNED`` holds what ``benchmarks/tune_nvfp4_moe.py`` measured on the H200; it writes the block
between the ``TUNED`` markers itself (``--apply``), so a tuning run patches this file in one step.
Shapes it does not list use ``DEFAULT``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from freetoken.kernels.triton._common import INTERPRETED
from freetoken.kernels.triton.moe_configs import GemmConfig, config_source



@dataclass(frozen=True)
class Nvfp4GemmConfig(GemmConfig):
    """``GemmConfig`` (tiles, row-tile groups, warps, stages), ``swap_ab``: the kernel computes
    the transposed product, decoded weights as the MMA's first operand (``nvfp4._mma``), and
    ``fold_bias``: the decode's ``2^126`` bias folded into the group scale, one bf16x2 multiply a
    weight pair instead of two, the rest of the power of two taken by the row scale (exact;
    ``nvfp4._pairs_asm``). ``split`` (folded too): the codes decoded elementwise into their even
    (low-nibble) and odd (high-nibble) columns, two MMAs a K step against the activations' even and
    odd columns (``nvfp4.split_columns``, one copy a call), so the decoded weights need no layout
    conversion into the MMA operand's (``nvfp4._decode_split``)."""

    swap_ab: bool = False
    fold_bias: bool = False
    split: bool = False

    def __post_init__(self) -> None:
        if self.split and self.block_k < 32:  # each half of a K step is one MMA's K, at least 16
            raise ValueError(f"Nvfp4GemmConfig.split needs block_k >= 32, got {self.block_k}")
        # Compiled, the decode turns a 32-bit word of four code bytes into eight weights a PTX call
        # (``nvfp4._decode_tile``, ``pack=4``); a tile of fewer code bytes than four a thread has its
        # words padded with undefined bytes, and decoded wrong (16 x 32 at 4 warps on the H100).
        code_bytes = self.block_n * self.block_k // 2
        if code_bytes < 4 * 32 * self.num_warps:
            raise ValueError(
                f"Nvfp4GemmConfig: a {self.block_n} x {self.block_k} weight tile is {code_bytes} code bytes, fewer "
                f"than 4 a thread at {self.num_warps} warps ({4 * 32 * self.num_warps})"
            )


C = Nvfp4GemmConfig
# (largest mean pairs per expert, config), increasing; the last bucket has no upper bound. A config
# of ``None`` (``DEQUANT``): dequantize the experts to the activation dtype, in groups of
# ``DEQUANT_GROUP_BYTES``, and run the bf16 grouped GEMM (``kernels/triton/moe.py``) on each group.
DEQUANT = None
Buckets = tuple[tuple[float, Nvfp4GemmConfig | None], ...]

# From the SASS of each tile (``benchmarks/nvfp4_sass.py``, sm_90) until ``tune_nvfp4_moe.py`` has
# measured them: the transposed product (``swap_ab``, weights as wgmma's register operand, the
# pairs its N side) at 5.8 instructions a decoded weight against 7.2-7.7, one row tile an expert
# up to 32 pairs; past 96 pairs an expert (an 8k prefill: 256) the decode would be repeated per
# row tile, and the dequantized bf16 GEMM runs instead. Up to 12 pairs (batch-64 decode: 2) the
# previous decode tile, narrow and deep (more programs and bytes in flight for a byte-bound GEMM),
# until ``--tokens 64`` has measured the others there.
DEFAULT: dict[str, Buckets] = {
    # gate/up decodes two weight tiles (gate and up, 2 x block_n rows) per K step.
    "gate_up": (
        (12, C(16, 32, 256, 8, 4, 4)),
        (48, C(32, 64, 128, 8, 4, 3, True)),
        (96, C(64, 64, 128, 8, 4, 3, True)),
        (float("inf"), DEQUANT),
    ),
    "down": (
        (12, C(16, 32, 256, 8, 4, 4)),
        (48, C(32, 64, 128, 8, 4, 3, True)),
        (96, C(64, 64, 128, 8, 4, 3, True)),
        (float("inf"), DEQUANT),
    ),
}

# BEGIN TUNED (written by benchmarks/tune_nvfp4_moe.py --apply)
# NVIDIA H200, 2026-12-02, tokens [528, 8192] (528 swept again with --tail in session 21)
TUNED: dict[tuple[str, int, int, int], Buckets] = {
    ("gate_up", 2048, 512, 256): (
        (12, C(16, 32, 256, 8, 4, 4, False, False, False)),
        (48, C(32, 64, 128, 8, 4, 3, True, True, True)),  # T=528: 269 us, 1126 GB/s
        (96, C(64, 64, 128, 8, 4, 3, True, False, False)),
        (float("inf"), DEQUANT),  # T=8192: 1096 us, 276 GB/s
    ),
    ("down", 2048, 512, 256): (
        (12, C(16, 32, 256, 8, 4, 4, False, False, False)),
        (48, C(32, 128, 64, 8, 8, 3, True, True, False)),  # T=528: 138 us, 1109 GB/s
        (96, C(64, 64, 128, 8, 4, 3, True, False, False)),
        (float("inf"), DEQUANT),  # T=8192: 625 us, 245 GB/s
    ),
}
# END TUNED

# The dequantize-then-bf16 path's scratch: experts are dequantized this many bytes at a time (a
# group's weights in the activation dtype), so the extra memory of a prefill step stays bounded.
DEQUANT_GROUP_BYTES = 256 << 20

# ``nvfp4_linear``'s W4A16 tiles from 17 rows to ``LINEAR_DEQUANT_MIN_ROWS``: (largest rows,
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB)); ``swap_ab``: the transposed
# product, the decoded weights as wgmma's register operand instead of a shared-memory round trip.
LINEAR_TILES: tuple[tuple[float, tuple[int, int, int, int, int, bool]], ...] = (
    (64, (64, 128, 64, 4, 4, False)),
    (float("inf"), (128, 128, 64, 8, 3, False)),
)

# ``nvfp4_linear`` past this many rows dequantizes the weight (``out x in`` in the activation dtype,
# once a call) and runs cuBLAS: its tensor-core tiles decode every weight once per 128-row tile, 64
# times at an 8k prefill, against a dequantization that reads the packed bytes once. Tuned by
# ``benchmarks/tune_nvfp4_moe.py`` (its dense cases); up to 16 rows stays on the W4A16 kernels.
# 512 from the prefix hit's 640-token graph on the H200 (session 23, docs/benchmarks.md): the
# attention projections there took 96 / 90 us as W4A16 tiles against 54 / 29 dequantized, and the
# cached TTFT fell from 37.4 to 35.0 ms with every NVFP4 linear of 512+ rows dequantized.
LINEAR_DEQUANT_MIN_ROWS = 512


def nvfp4_moe_config(
    gemm: str, dtype: torch.dtype, num_pairs: int, num_experts: int, hidden: int, inter: int
) -> Nvfp4GemmConfig | None:
    """The tiles of ``gemm`` (``"gate_up"`` or ``"down"``) for this launch, or ``None`` (``DEQUANT``)."""
    mean_rows = num_pairs / max(num_experts, 1)
    buckets = TUNED.get((gemm, hidden, inter, num_experts), DEFAULT[gemm])
    config = next(c for bound, c in buckets if mean_rows <= bound)
    return None if config is DEQUANT else for_dtype(config, dtype)


def for_dtype(config: Nvfp4GemmConfig, dtype: torch.dtype) -> Nvfp4GemmConfig:
    """A bf16 configuration as launched for ``dtype`` (and under the interpreter)."""
    if INTERPRETED:  # few, large programs: the interpreter's cost is per program and operation
        return replace(config, block_m=min(config.block_m, 64), block_n=64, block_k=128, num_stages=1)
    if dtype == torch.float32:  # float32 activations: narrower tiles to fit shared memory
        return replace(config, block_m=min(config.block_m, 64), block_n=64, block_k=32, num_warps=4, num_stages=2)
    return config


def format_buckets(buckets: Buckets, comments: dict[float, str] | None = None) -> str:
    """``buckets`` as the Python source of ``TUNED``'s entries (one bucket a line)."""
    lines = []
    for bound, config in buckets:
        bound_src = 'float("inf")' if bound == float("inf") else f"{bound:g}"
        config_src = "DEQUANT" if config is None else config_source(config)
        comment = f"  # {comments[bound]}" if comments and bound in comments else ""
        lines.append(f"        ({bound_src}, {config_src}),{comment}")
    return "\n".join(lines)
