"""Triton W4A16 GEMMs over NVFP4 weights (Hopper has no FP4 tensor cores).

Each program loads its weight tile packed (half a byte a weight, plus one e4m3 byte per 16), decodes
it in registers to ``e2m1 · e4m3`` (exact in bf16, see ``kernels/nvfp4.py``; the codes through the
hardware fp8 conversion, ``_decode_tile``) and multiplies it with
the activations on the tensor cores (``tl.dot``, float32 accumulation); the per-row scale is applied
to the accumulator. Decode-sized batches (a few rows) read each packed byte once and are bound by
those bytes: up to ``nvfp4_rows.GEMV_MAX_ROWS`` rows without tensor cores (``nvfp4_gemv``, whole
packed rows a program), up to 16 in narrow tensor-core tiles; prefill-sized ones run large bf16
tiles, and past ``nvfp4_configs.LINEAR_DEQUANT_MIN_ROWS`` rows the weight is dequantized once
(``dequantize_nvfp4``) and multiplied by cuBLAS: the tiles would decode each weight once per row tile.

``fused_experts_nvfp4`` is ``fused_experts`` (``kernels/triton/moe.py``: sort pairs by expert,
grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM, per-token sum) with these weight tiles,
their sizes from ``nvfp4_configs`` by pairs per expert; where that table says ``DEQUANT`` (an 8k
prefill's hundreds of pairs an expert) the experts are dequantized a group at a time and run through
the bf16 grouped GEMMs instead. With ``expert_slots`` (an expert cache's slot map, as
``fused_experts``') every tile, and the dequantization, reads its expert's parts at its slot. Two
decode variants are table choices (``Nvfp4GemmConfig``): ``fold_bias`` (one bf16x2 multiply a weight
pair, the bias in the scale) and ``split`` (the even and odd columns decoded elementwise and
multiplied apart, so the decoded weights need no layout conversion through shared memory into the
MMA operand's).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from freetoken.kernels.triton import moe, nvfp4_configs
from freetoken.kernels.triton._common import _INTERPRETED, INTERPRETED, cast, device_function, dot, dot_precision, new_empty, pow2, round_as
from freetoken.kernels.triton.moe import (
    _grouped_tile,
    _slot_of,
    checked_slots,
    moe_sort_tokens,
    sum_choices,
    tile_map,
)
from freetoken.kernels.triton.moe_configs import moe_gemm_config
from freetoken.kernels.triton.nvfp4_configs import Nvfp4GemmConfig, nvfp4_moe_config
from freetoken.kernels.triton.nvfp4_rows import GEMV_MAX_ROWS, _e4m3_codes, nvfp4_gemv

GROUP = 16


# One 32-bit register of 4 packed bytes (8 codes, columns 0-7) and a bf16x2 register holding their
# group's scale twice -> 4 bf16x2 registers of exact ``e2m1 · e4m3``, columns (0, 1), (2, 3)
# (outputs $0, $1) and (4, 5), (6, 7) ($2, $3): each register already holds the two consecutive
# columns a bf16 MMA operand register takes, so no shuffle follows. For byte j, one prmt puts byte j
# of ``q << 4`` (the low nibble in bits 7-4) in the low half's high byte and byte j of ``q`` (the high
# nibble there) in the high half's; the sign then sits at bit 15 of each half and exponent / mantissa
# at bits 14-12, moved to 8-6: ``e2m1 · 2^-126`` (0.5 a bf16 subnormal); one ``mul.bf16x2`` by 2^126
# (as Marlin does) and one by the scale. ``SCALED`` 0: the codes alone (inputs $4 only). ``FOLDED``:
# the bias folded into the scale operand, one ``mul.bf16x2`` a pair: $5 holds ``e4m3 · 2^118``
# (``_FOLDED_SCALE``, exact in bf16 for every e4m3 value), so the product is ``e2m1 · e4m3 · 2^-8``, a
# bf16 normal with at most 6 significant bits in [2^-18, 10.5] (exact; a subnormal ``e2m1 · 2^-126``
# operand is multiplied as the bias multiply already does), and the caller's float32 row scale
# takes the ``2^8`` (``FOLD``) back, a power of two, so the float32 result is unchanged.
def _pairs_asm(scaled: bool, folded: bool = False) -> str:
    bias = [] if folded else [".reg .b32 bias;", "mov.b32 bias, 0x7E807E80;"]
    lines = ["{", ".reg .b32 q4, t, s;", *bias, "shl.b32 q4, $4, 4;"]
    for out, sel in enumerate(("0x0044", "0x1155", "0x2266", "0x3377")):
        lines += [f"prmt.b32 t, $4, q4, {sel};", "shr.b32 s, t, 6;", "and.b32 s, s, 0x01C001C0;",
                  "and.b32 t, t, 0x80008000;", "or.b32 t, t, s;"]
        if folded:
            lines += [f"mul.rn.bf16x2 ${out}, t, $5;"]
        else:
            lines += ["mul.rn.bf16x2 t, t, bias;", f"mul.rn.bf16x2 ${out}, t, $5;"] if scaled else [f"mul.rn.bf16x2 ${out}, t, bias;"]
    return "\n".join(lines + ["}"])


_PAIRS_TO_BF16 = tl.constexpr(_pairs_asm(False))
_SCALED_PAIRS_TO_BF16 = tl.constexpr(_pairs_asm(True))
_FOLDED_PAIRS_TO_BF16 = tl.constexpr(_pairs_asm(True, folded=True))


# The split decode (``Nvfp4GemmConfig.split``): 4 packed bytes and their 4 bf16 scales (``e4m3 ·
# 2^118``, as folded; $5 bytes 0-1, $6 bytes 2-3) -> the 4 low-nibble (even-column) values as $0
# (bytes 0, 1) and $1 (2, 3), the 4 high-nibble (odd-column) ones as $2 and $3, each
# ``e2m1 · e4m3 · 2^-8``: output element i is byte i's, so the decode is elementwise over the byte
# tile and keeps whatever layout it is in (the MMA operand's: no shared-memory round trip).
def _split_asm() -> str:
    lines = ["{", ".reg .b32 q4, t, s;", "shl.b32 q4, $4, 4;"]
    for out, (src, sel, scale) in enumerate((("q4", "0x1100", "$5"), ("q4", "0x3322", "$6"),
                                             ("$4", "0x1100", "$5"), ("$4", "0x3322", "$6"))):
        lines += [f"prmt.b32 t, {src}, {src}, {sel};", "shr.b32 s, t, 6;", "and.b32 s, s, 0x01C001C0;",
                  "and.b32 t, t, 0x80008000;", "or.b32 t, t, s;", f"mul.rn.bf16x2 ${out}, t, {scale};"]
    return "\n".join(lines + ["}"])


_SPLIT_TO_BF16 = tl.constexpr(_split_asm())
_FOLDED_SCALE = tl.constexpr(2.0**118)  # the e4m3 scale's factor in the folded decode's bf16 operand
FOLD = tl.constexpr(256.0)  # what a folded tile is short of (2^126 / 2^118), the row scale takes it back
_UNFOLD = tl.constexpr(1.0 / 256.0)


@device_function
def _words_to_tile(lo, hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The two ``[BLOCK_N, BLOCK_K / 2]`` outputs of the pair decode (columns 0-3 and 4-7 of each
    word) as the ``[BLOCK_N, BLOCK_K]`` tile; the permute only renames registers."""
    words = tl.join(tl.reshape(lo, (BLOCK_N, BLOCK_K // 8, 4)), tl.reshape(hi, (BLOCK_N, BLOCK_K // 8, 4)))
    return tl.reshape(tl.permute(words, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


@device_function
def _per_byte(group_scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K / 16]`` group scales repeated for each of a group's 8 code bytes."""
    return tl.reshape(tl.broadcast_to(group_scales[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))


@device_function
def _decode_tile(packed, scale_bytes, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FOLDED: tl.constexpr = False):
    """uint8 ``[BLOCK_N, BLOCK_K / 2]`` codes and ``[BLOCK_N, BLOCK_K / 16]`` e4m3 bytes -> ``dtype``
    ``[BLOCK_N, BLOCK_K]`` weights ``e2m1 · e4m3`` (the row scale is applied by the caller); with
    ``FOLDED`` ``e2m1 · e4m3 · 2^-8`` on every path (the caller's row scale times ``FOLD``), which
    compiled in bf16 saves one ``mul.bf16x2`` a pair (``_pairs_asm``).

    ``e2m1 · e4m3`` has at most 6 significant bits and lies in [2^-10, 2688]: exact in bf16 and fp16,
    so the scale multiplies in ``dtype``, with no float32 round trip. Compiled, the codes go straight
    to bf16 a 32-bit word at a time in inline PTX (``_pairs_asm``), in bf16 with the scale multiplied
    there too, a pair at a time (Triton's own multiply paired elements of different groups and
    redid half of them one by one); Triton's byte-wise ops and e4m3 -> f16 -> bf16 conversions took
    ~11 instructions a weight (docs/benchmarks.md). The interpreter, which runs no PTX and no bf16
    arithmetic, moves each nibble's bits into an e4m3 code (sign to bit 7, exponent and mantissa to
    bits 4-2: ``e2m1 · 2^-6`` for all 16 codes, the subnormal 0.5 on e4m3's subnormal 2^-7) and forms
    the same exact product in float32."""
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True)
    if _INTERPRETED:
        codes = tl.reshape(_e4m3_codes(packed), (BLOCK_N, BLOCK_K)).to(tl.float8e4nv, bitcast=True)
        if FOLDED:
            factor = 64.0 * _UNFOLD
        else:
            factor = 64.0
        groups = tl.reshape(codes.to(tl.float32), (BLOCK_N, BLOCK_K // 16, 16)) * (scales.to(tl.float32) * factor)[:, :, None]
        return tl.reshape(groups, (BLOCK_N, BLOCK_K)).to(dtype)
    elif dtype == tl.bfloat16:
        if FOLDED:  # (a string assigned to a variable would stop being a constexpr)
            per_byte = _per_byte((scales.to(tl.float32) * _FOLDED_SCALE).to(tl.bfloat16), BLOCK_N, BLOCK_K)
            lo, hi = tl.inline_asm_elementwise(_FOLDED_PAIRS_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed, per_byte],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            per_byte = _per_byte(scales.to(tl.bfloat16), BLOCK_N, BLOCK_K)
            lo, hi = tl.inline_asm_elementwise(_SCALED_PAIRS_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed, per_byte],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return _words_to_tile(lo, hi, BLOCK_N, BLOCK_K)
    else:
        lo, hi = tl.inline_asm_elementwise(_PAIRS_TO_BF16, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
        values = _words_to_tile(lo, hi, BLOCK_N, BLOCK_K).to(dtype)
        if FOLDED:
            group_scales = (scales.to(tl.float32) * _UNFOLD).to(dtype)
        else:
            group_scales = scales.to(dtype)
        groups = tl.reshape(values, (BLOCK_N, BLOCK_K // 16, 16)) * group_scales[:, :, None]
        return tl.reshape(groups, (BLOCK_N, BLOCK_K)).to(dtype)


@device_function
def _decode_split(packed, scale_bytes, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 ``[BLOCK_N, BLOCK_K / 2]`` codes and their ``[BLOCK_N, BLOCK_K / 16]`` e4m3 bytes -> the
    even and the odd columns' weights, two ``dtype`` ``[BLOCK_N, BLOCK_K / 2]`` tiles of
    ``e2m1 · e4m3 · 2^-8`` (folded: the caller's row scale times ``FOLD``), element j of each from
    byte j: no join or reshape of the weights, so their layout can be the MMA operand's."""
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # converted a group at a time
    if _INTERPRETED or dtype != tl.bfloat16:
        lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)  # e2m1 · 2^-6 as e4m3 bytes (_e4m3_codes)
        hi = (packed & 0x80) | ((packed & 0x70) >> 2)
        factor = _per_byte(scales * (64.0 * _UNFOLD), BLOCK_N, BLOCK_K)
        even = lo.to(tl.float8e4nv, bitcast=True).to(tl.float32) * factor
        odd = hi.to(tl.float8e4nv, bitcast=True).to(tl.float32) * factor
        return even.to(dtype), odd.to(dtype)
    else:
        per_byte = _per_byte((scales * _FOLDED_SCALE).to(tl.bfloat16), BLOCK_N, BLOCK_K)
        even, odd = tl.inline_asm_elementwise(_SPLIT_TO_BF16, "=r,=r,=r,=r,r,r,r", [packed, per_byte],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return even, odd


@device_function
def _load_tile(w_ptr, s_ptr, rows, rows_ok, k0, K, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The decoded ``[BLOCK_N, BLOCK_K]`` tile of input columns ``k0 ...`` of weight rows ``rows``
    (``w_ptr``: packed ``[*, K / 2]`` rows, ``s_ptr``: scale ``[*, K / 16]`` rows) in ``dtype``."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rows[:, None].to(tl.int64) * (K // 2) + half[None, :],
                     mask=rows_ok[:, None] & (half < K // 2)[None, :], other=0)
    group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scales = tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + group[None, :],
                     mask=rows_ok[:, None] & (group < K // 16)[None, :], other=0)
    return _decode_tile(packed, scales, dtype, BLOCK_N, BLOCK_K)


@triton.jit
def _linear_kernel(
    x_ptr, x_st, w_ptr, s_ptr, r_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = n < N
    m_ok = m < M
    dtype = out_ptr.dtype.element_ty
    acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * x_st + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        w = _load_tile(w_ptr, s_ptr, n, n_ok, k0, K, dtype, BLOCK_N, BLOCK_K)
        acc = _mma(acc, a, w, SWAP_AB, PRECISION)
    acc = _rows_first(acc, SWAP_AB)
    row_scale = tl.load(r_ptr + n, mask=n_ok, other=0.0)
    out = acc * row_scale[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], cast(out, dtype), mask=m_ok[:, None] & n_ok[None, :])


def _linear_tiles(num_rows: int, n_out: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP_AB): past 16 rows from
    ``nvfp4_configs.LINEAR_TILES`` by rows; float32 and the interpreter narrower."""
    if INTERPRETED:
        return min(pow2(num_rows, 16), 64), 64, 128, 4, 1, num_rows > 32
    if num_rows <= 16:  # decode: narrow weight tiles, so that a few hundred programs stream the bytes
        return 16, 16 if n_out <= 4096 else 32, 256, 4, 4, False
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2, False
    return next(tiles for bound, tiles in nvfp4_configs.LINEAR_TILES if num_rows <= bound)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    n_out, half = packed.shape
    k_in = 2 * half
    if x.shape[-1] != k_in or scales.shape != (n_out, k_in // GROUP) or row_scales.shape != (n_out,):
        raise ValueError(
            f"nvfp4_linear: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, "
            f"row_scales {tuple(row_scales.shape)} disagree"
        )
    rows = x.reshape(-1, k_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = new_empty((num_rows, n_out), x.dtype, x.device)
    if num_rows >= nvfp4_configs.LINEAR_DEQUANT_MIN_ROWS:
        return F.linear(x, dequantize_nvfp4(packed, scales, row_scales, x.dtype))
    if 0 < num_rows <= GEMV_MAX_ROWS:
        nvfp4_gemv(rows, packed.contiguous(), scales.contiguous().view(torch.uint8), row_scales.contiguous(), out)
    elif num_rows:
        block_m, block_n, block_k, warps, stages, swap = _linear_tiles(num_rows, n_out, x.dtype)
        _linear_kernel[(triton.cdiv(n_out, block_n), triton.cdiv(num_rows, block_m))](
            rows, rows.stride(0), packed.contiguous(), scales.contiguous().view(torch.uint8), row_scales.contiguous(), out,
            num_rows, n_out, k_in,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP_AB=swap, PRECISION=dot_precision(x.dtype),
            num_warps=warps, num_stages=stages,
        )
    return out.reshape(*x.shape[:-1], n_out)


@device_function
def _packed_tile(w_ptr, rows, rows_ok, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """uint8 codes ``[BLOCK_N, BLOCK_K / 2]`` of input columns ``k0 ...`` of weight rows ``rows``."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * (K // 2) + half[None, :],
                   mask=rows_ok[:, None] & ((half < K // 2) | EVEN_K)[None, :], other=0)


@device_function
def _scale_tile(s_ptr, rows, rows_ok, k0, K, BLOCK_K: tl.constexpr):
    """e4m3 bytes ``[BLOCK_N, BLOCK_K / 16]`` of input columns ``k0 ...``.

    Triton's pipeliner streams the packed codes and the activations through shared memory (cp.async)
    but leaves these 8-16-byte rows a synchronous load in the step that uses them (TTGIR, sm_90).
    Loading them a step ahead into loop-carried registers hides that latency but moved the decoded
    tiles' layout off the MMA operand's (a shared-memory round trip a weight): not done."""
    group = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    return tl.load(s_ptr + rows[:, None].to(tl.int64) * (K // 16) + group[None, :],
                   mask=rows_ok[:, None] & (group < K // 16)[None, :], other=0)


@device_function
def _split_activations(x_ptr, x_st, rows, rows_ok, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """For a split decode: the even and the odd columns ``k0 ...`` of activation rows, two contiguous
    ``[BLOCK_M, BLOCK_K / 2]`` tiles of the column-split activations (``split_columns``: the even
    columns, then the odd ones)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = rows_ok[:, None] & ((half < K // 2) | EVEN_K)[None, :]
    base = x_ptr + rows[:, None].to(tl.int64) * x_st + half[None, :]
    return tl.load(base, mask=mask, other=0.0), tl.load(base + K // 2, mask=mask, other=0.0)


@device_function
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The float32 accumulator: ``[BLOCK_M, BLOCK_N]``, or transposed with ``SWAP_AB``."""
    if SWAP_AB:
        return tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], tl.float32)


@device_function
def _mma(acc, a, w, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += a @ wᵀ`` (activations ``a [BLOCK_M, BLOCK_K]``, decoded weights ``w [BLOCK_N,
    BLOCK_K]``), or with ``SWAP_AB`` the transposed product ``acc += w @ aᵀ``: the weights then are
    the MMA's first operand, which the tensor cores take from registers (where the decode leaves
    them; wgmma's second operand must be in shared memory), and a few tokens are its narrow N side
    (8 on) instead of a 16- or 64-row M side padded with empty rows. With the activations first,
    mma.sync's A fragments were regathered with 4 moves before every MMA (1.75 a weight at 32 x 64 x
    128, ``benchmarks/nvfp4_sass.py``)."""
    if SWAP_AB:
        return acc + dot(w, tl.trans(a), PRECISION)
    else:
        return acc + dot(a, tl.trans(w), PRECISION)


@device_function
def _rows_first(acc, SWAP_AB: tl.constexpr):
    """The accumulator as ``[BLOCK_M, BLOCK_N]`` for the epilogue."""
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@device_function
def _row_scales(r_ptr, rows, rows_ok, FOLDED: tl.constexpr):
    """The float32 row scales of ``rows``, times ``FOLD`` for a ``FOLDED`` decode's tiles."""
    scales = tl.load(r_ptr + rows, mask=rows_ok, other=0.0)
    if FOLDED:
        scales = scales * FOLD
    return scales


@triton.jit
def _gate_up_kernel(
    x_ptr, x_st, w_ptr, s_ptr, r_ptr, w_es, s_es, r_es, order_ptr, tiles_ptr, slots_ptr, h_ptr,
    hidden, inter, num_experts, num_row_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, FOLDED: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    tile, col_block = _grouped_tile(num_row_tiles, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_row_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_row_tiles + tile)
    if expert < num_experts:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        token = tl.load(order_ptr + rows, mask=row_ok, other=0) // TOP_K
        n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        dtype = h_ptr.dtype.element_ty
        # The expert's parts from their expert strides (``*_es``, elements), at its row of the weight
        # tensors (``_slot_of``: its cache slot with ``HAS_SLOTS``): its rows are contiguous.
        slot = _slot_of(expert, slots_ptr, HAS_SLOTS).to(tl.int64)
        w_ptr += slot * w_es
        s_ptr += slot * s_es
        r_ptr += slot * r_es
        gate_rows = n
        up_rows = n + inter
        acc_gate = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
        acc_up = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
        for k0 in range(0, hidden, BLOCK_K):
            s_gate = _scale_tile(s_ptr, gate_rows, n_ok, k0, hidden, BLOCK_K)
            s_up = _scale_tile(s_ptr, up_rows, n_ok, k0, hidden, BLOCK_K)
            gate_codes = _packed_tile(w_ptr, gate_rows, n_ok, k0, hidden, BLOCK_K, EVEN_K)
            up_codes = _packed_tile(w_ptr, up_rows, n_ok, k0, hidden, BLOCK_K, EVEN_K)
            if SPLIT:
                a_even, a_odd = _split_activations(x_ptr, x_st, token, row_ok, k0, hidden, BLOCK_K, EVEN_K)
                g_even, g_odd = _decode_split(gate_codes, s_gate, dtype, BLOCK_N, BLOCK_K)
                u_even, u_odd = _decode_split(up_codes, s_up, dtype, BLOCK_N, BLOCK_K)
                acc_gate = _mma(_mma(acc_gate, a_even, g_even, SWAP_AB, PRECISION), a_odd, g_odd, SWAP_AB, PRECISION)
                acc_up = _mma(_mma(acc_up, a_even, u_even, SWAP_AB, PRECISION), a_odd, u_odd, SWAP_AB, PRECISION)
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = (k < hidden) | EVEN_K  # constant true when the tiles divide the dim: no column mask
                a = tl.load(x_ptr + token[:, None].to(tl.int64) * x_st + k[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_gate = _decode_tile(gate_codes, s_gate, dtype, BLOCK_N, BLOCK_K, FOLDED)
                w_up = _decode_tile(up_codes, s_up, dtype, BLOCK_N, BLOCK_K, FOLDED)
                acc_gate = _mma(acc_gate, a, w_gate, SWAP_AB, PRECISION)
                acc_up = _mma(acc_up, a, w_up, SWAP_AB, PRECISION)
        acc_gate = _rows_first(acc_gate, SWAP_AB)
        acc_up = _rows_first(acc_up, SWAP_AB)
        gate = round_as(acc_gate * _row_scales(r_ptr, gate_rows, n_ok, FOLDED)[None, :], dtype)
        up = round_as(acc_up * _row_scales(r_ptr, up_rows, n_ok, FOLDED)[None, :], dtype)
        h = round_as(gate * tl.sigmoid(gate), dtype) * up
        tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + n[None, :], cast(h, dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, s_ptr, r_ptr, w_es, s_es, r_es, order_ptr, tiles_ptr, slots_ptr, topk_w_ptr, y_ptr,
    hidden, inter, num_experts, num_row_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, FOLDED: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    tile, col_block = _grouped_tile(num_row_tiles, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(tiles_ptr + tile)
    first = tl.load(tiles_ptr + num_row_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_row_tiles + tile)
    if expert < num_experts:
        rows = first + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
        n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        dtype = y_ptr.dtype.element_ty
        slot = _slot_of(expert, slots_ptr, HAS_SLOTS).to(tl.int64)  # the expert's parts, as in ``_gate_up_kernel``
        w_ptr += slot * w_es
        s_ptr += slot * s_es
        r_ptr += slot * r_es
        w_rows = n
        acc = _zero_acc(BLOCK_M, BLOCK_N, SWAP_AB)
        for k0 in range(0, inter, BLOCK_K):
            codes = _packed_tile(w_ptr, w_rows, n_ok, k0, inter, BLOCK_K, EVEN_K)
            scales = _scale_tile(s_ptr, w_rows, n_ok, k0, inter, BLOCK_K)
            if SPLIT:
                a_even, a_odd = _split_activations(h_ptr, inter, rows, row_ok, k0, inter, BLOCK_K, EVEN_K)
                w_even, w_odd = _decode_split(codes, scales, dtype, BLOCK_N, BLOCK_K)
                acc = _mma(_mma(acc, a_even, w_even, SWAP_AB, PRECISION), a_odd, w_odd, SWAP_AB, PRECISION)
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = (k < inter) | EVEN_K
                a = tl.load(h_ptr + rows[:, None].to(tl.int64) * inter + k[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                acc = _mma(acc, a, _decode_tile(codes, scales, dtype, BLOCK_N, BLOCK_K, FOLDED), SWAP_AB, PRECISION)
        acc = _rows_first(acc, SWAP_AB)
        weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        y = round_as(acc * _row_scales(r_ptr, w_rows, n_ok, FOLDED)[None, :], dtype) * weight[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * hidden + n[None, :], cast(y, dtype),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, r_ptr, out_ptr, w_es, s_es, r_es, num_rows, K, slots_ptr, offsets_ptr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """Rows ``[BLOCK_R]`` x columns ``[BLOCK_K]`` of expert ``program_id(2)``'s dense weight (its parts
    ``*_es`` elements apart, ``num_rows`` rows each): ``e2m1 · e4m3`` (exact in the output dtype)
    times the row scale in float32, rounded once, as ``dequantize_nvfp4``. ``HAS_SLOTS``: the
    expert's parts are row ``slots[expert]`` of the inputs (``_slot_of``), and an expert no pair
    routes to (``offsets``) is skipped, its slot never read (-1 for an expert not cached)."""
    expert = tl.program_id(2)
    routed = True
    if HAS_SLOTS:
        routed = tl.load(offsets_ptr + expert + 1) > tl.load(offsets_ptr + expert)
    if routed:
        slot = _slot_of(expert, slots_ptr, HAS_SLOTS).to(tl.int64)
        w_ptr += slot * w_es
        s_ptr += slot * s_es
        r_ptr += slot * r_es
        out_ptr += expert.to(tl.int64) * num_rows * K
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rows_ok = rows < num_rows
        k0 = tl.program_id(1) * BLOCK_K
        dtype = out_ptr.dtype.element_ty
        w = _load_tile(w_ptr, s_ptr, rows, rows_ok, k0, K, dtype, BLOCK_R, BLOCK_K)
        out = w.to(tl.float32) * tl.load(r_ptr + rows, mask=rows_ok, other=0.0)[:, None]
        k = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * K + k[None, :], cast(out, dtype),
                 mask=rows_ok[:, None] & (k < K)[None, :])


def dequantize_nvfp4_into(packed: torch.Tensor, scale_bytes: torch.Tensor, row_scales: torch.Tensor,
                          out: torch.Tensor, expert_slots: torch.Tensor | None = None,
                          offsets: torch.Tensor | None = None) -> None:
    """``out [E, N, K] = dequantize_nvfp4(...)`` of the first ``E`` experts of ``packed [E', N, K / 2]``
    in ``out``'s dtype (contiguous), scales as uint8; the inputs' expert strides are free, their rows
    contiguous (``expert_major``). With ``expert_slots`` (int32, at least ``E``) and the pairs'
    ``offsets`` by expert: ``out[e]`` is row ``expert_slots[e]``'s, for the experts ``e`` some pair
    routes to (the others' rows of ``out`` are left as they were)."""
    num_experts, num_rows, k_in = out.shape
    if not num_experts * num_rows * k_in:
        return
    has_slots = expert_slots is not None
    if has_slots and offsets is None:
        raise ValueError("dequantize_nvfp4_into: expert_slots needs the pairs' offsets")
    block_r, block_k = (64, 128) if INTERPRETED else (16, 256)
    _dequant_kernel[(triton.cdiv(num_rows, block_r), triton.cdiv(k_in, block_k), num_experts)](
        packed, scale_bytes, row_scales, out, packed.stride(0), scale_bytes.stride(0), row_scales.stride(0),
        num_rows, k_in, expert_slots if has_slots else row_scales, offsets if has_slots else row_scales,
        BLOCK_R=block_r, BLOCK_K=block_k, HAS_SLOTS=has_slots, num_warps=4,
    )


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.nvfp4.dequantize_nvfp4`` in one launch (bit-identical): the weight ``[*, out, in]``."""
    *lead, rows, half = packed.shape
    out = new_empty((*lead, rows, 2 * half), dtype, packed.device)
    dequantize_nvfp4_into(packed.contiguous().view(-1, rows, half), scales.contiguous().view(torch.uint8).view(-1, rows, half // 8),
                          row_scales.contiguous().view(-1, rows), out.view(-1, rows, 2 * half))
    return out


Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # packed codes, scale bytes (uint8), row scales


def expert_major(t: torch.Tensor) -> torch.Tensor:
    """``t [E, ...]`` as the grouped kernels read it: its inner dims contiguous (one expert's rows as
    a tensor of its own), its expert stride free. ``t`` itself when it is so (a contiguous tensor,
    or an expert span's view, ``experts.span``: copying one would cost the whole layer's experts),
    else a contiguous copy."""
    return t if t.shape[0] == 0 or t[0].is_contiguous() else t.contiguous()


def _expert_strides(w: Packed) -> tuple[int, int, int]:
    """Each part's expert stride, in its elements."""
    return w[0].stride(0), w[1].stride(0), w[2].stride(0)


def _expert_groups(num_experts: int, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Experts dequantized at a time by the dequantize-then-bf16 path (``DEQUANT_GROUP_BYTES``)."""
    per_expert = rows * cols * torch.tensor([], dtype=dtype).element_size()
    return max(1, min(num_experts, nvfp4_configs.DEQUANT_GROUP_BYTES // per_expert))


def _dequantized_groups(w: Packed, dtype: torch.dtype, device: torch.device, offsets: torch.Tensor,
                        expert_slots: torch.Tensor | None) -> Iterator[tuple[int, torch.Tensor]]:
    """The dequantize-then-bf16 path's expert groups in turn: ``(first expert, the group's weights
    in dtype)``, every group dequantized into one scratch buffer, so each is consumed (its grouped
    GEMM enqueued) before the next overwrites it. The experts are those of ``offsets``; with
    ``expert_slots`` each is read from its slot (only the routed ones), into the group's rows in
    expert order, so the bf16 GEMM sees contiguous experts."""
    packed, scale_bytes, row_scales = w
    _, rows, half = packed.shape
    num_experts = offsets.shape[0] - 1
    group = _expert_groups(num_experts, rows, 2 * half, dtype)
    scratch = new_empty((group, rows, 2 * half), dtype, device)
    for e0 in range(0, num_experts, group):
        weights = scratch[: min(group, num_experts - e0)]
        if expert_slots is None:
            dequantize_nvfp4_into(packed[e0:], scale_bytes[e0:], row_scales[e0:], weights)
        else:
            dequantize_nvfp4_into(packed, scale_bytes, row_scales, weights, expert_slots[e0:], offsets[e0:])
        yield e0, weights


def split_columns(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, K]``'s even columns, then its odd ones (``[rows, K]``, contiguous): the activations
    of a ``split`` decode, whose MMAs take the low-nibble and the high-nibble columns apart."""
    return torch.cat((x[:, 0::2], x[:, 1::2]), dim=1)


def gate_up_nvfp4(x: torch.Tensor, w13: Packed, order: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor,
                  top_k: int, config: Nvfp4GemmConfig | None, expert_slots: torch.Tensor | None = None) -> None:
    """``h[sorted pair] = silu(x w_gateᵀ) · (x w_upᵀ)`` of the pair's expert over NVFP4 ``w13``
    (``[E, 2I, H / 2]`` codes; each part ``expert_major``): the W4A16 kernel with ``config``'s tiles, or with
    ``None`` the experts dequantized a group at a time and the bf16 grouped GEMM (the tuner
    launches both). With ``expert_slots`` (``fused_experts_nvfp4``), expert ``e``'s parts are row
    ``expert_slots[e]`` of ``w13``'s (the experts are ``offsets``')."""
    packed, scale_bytes, row_scales = w13
    _, two_inter, half = packed.shape
    num_experts = offsets.shape[0] - 1
    hidden, inter = 2 * half, two_inter // 2
    if config is None:
        bf16_config = moe_gemm_config("gate_up", x.dtype, h.shape[0], num_experts, hidden, inter)
        for e0, weights in _dequantized_groups(w13, x.dtype, x.device, offsets, expert_slots):
            moe.gate_up(x, weights, order, offsets[e0:], h, top_k, bf16_config)
        return
    tile_info, tiles = tile_map(offsets, h.shape[0], config.block_m)
    x = split_columns(x) if config.split else x
    _gate_up_kernel[(tiles * triton.cdiv(inter, config.block_n),)](
        x, x.stride(0), packed, scale_bytes, row_scales, *_expert_strides(w13), order, tile_info,
        _slots_arg(expert_slots, offsets), h, hidden, inter, num_experts, tiles,
        TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, EVEN_K=hidden % config.block_k == 0,
        SWAP_AB=config.swap_ab, FOLDED=config.fold_bias or config.split, SPLIT=config.split, PRECISION=dot_precision(x.dtype),
        HAS_SLOTS=expert_slots is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def down_nvfp4(h: torch.Tensor, w2: Packed, order: torch.Tensor, offsets: torch.Tensor, topk_weights: torch.Tensor,
               y: torch.Tensor, config: Nvfp4GemmConfig | None, expert_slots: torch.Tensor | None = None) -> None:
    """``y[pair] = weight · (h w_downᵀ)`` of the pair's expert over NVFP4 ``w2`` (``[E, H, I / 2]``
    codes), in pair order; ``config`` and ``expert_slots`` as in ``gate_up_nvfp4``."""
    packed, scale_bytes, row_scales = w2
    _, hidden, half = packed.shape
    num_experts = offsets.shape[0] - 1
    inter = 2 * half
    if config is None:
        bf16_config = moe_gemm_config("down", h.dtype, h.shape[0], num_experts, hidden, inter)
        for e0, weights in _dequantized_groups(w2, h.dtype, h.device, offsets, expert_slots):
            moe.down(h, weights, order, offsets[e0:], topk_weights, y, bf16_config)
        return
    tile_info, tiles = tile_map(offsets, h.shape[0], config.block_m)
    h = split_columns(h) if config.split else h
    _down_kernel[(tiles * triton.cdiv(hidden, config.block_n),)](
        h, packed, scale_bytes, row_scales, *_expert_strides(w2), order, tile_info, _slots_arg(expert_slots, offsets),
        topk_weights, y, hidden, inter, num_experts, tiles,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, EVEN_K=inter % config.block_k == 0,
        SWAP_AB=config.swap_ab, FOLDED=config.fold_bias or config.split, SPLIT=config.split, PRECISION=dot_precision(h.dtype),
        HAS_SLOTS=expert_slots is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _slots_arg(expert_slots: torch.Tensor | None, offsets: torch.Tensor) -> torch.Tensor:
    """The kernels' ``slots_ptr``: ``expert_slots``, or without them any int32 tensor (never read)."""
    return offsets if expert_slots is None else expert_slots


def expert_configs(dtype: torch.dtype, num_pairs: int, num_experts: int, hidden: int,
                   inter: int) -> tuple[Nvfp4GemmConfig | None, Nvfp4GemmConfig | None]:
    """The (gate/up, down) launch configurations of ``fused_experts_nvfp4`` (``nvfp4_configs``)."""
    return (nvfp4_moe_config("gate_up", dtype, num_pairs, num_experts, hidden, inter),
            nvfp4_moe_config("down", dtype, num_pairs, num_experts, hidden, inter))


def fused_experts_nvfp4(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    two_inter = w13_packed.shape[1]
    num_experts = w13_packed.shape[0] if expert_slots is None else expert_slots.shape[0]
    inter = two_inter // 2
    return fused_experts_nvfp4_tiled(
        x, w13_packed, w13_scales, w13_row_scales, w2_packed, w2_scales, w2_row_scales, topk_weights, topk_ids,
        expert_configs(x.dtype, num_tokens * topk_ids.shape[-1], num_experts, hidden, inter), expert_slots,
    )


def fused_experts_nvfp4_tiled(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_row_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_row_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[Nvfp4GemmConfig | None, Nvfp4GemmConfig | None],
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts_nvfp4`` with the given (gate/up, down) configurations (tests and the tuner).
    The experts' parts may have any expert (dim 0) stride: only their rows must be contiguous, else
    they are copied (``expert_major``). ``expert_slots [E]`` (int32): as ``fused_experts``', expert
    ``e``'s parts are row ``expert_slots[e]`` of each (an expert cache's ``S`` slots); the pairs are
    sorted over its ``E`` experts."""
    num_tokens, hidden = x.shape
    rows, two_inter, _ = w13_packed.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if (
        w13_packed.shape[2] * 2 != hidden
        or w13_scales.shape != (rows, two_inter, hidden // GROUP)
        or w13_row_scales.shape != (rows, two_inter)
        or w2_packed.shape != (rows, hidden, inter // 2)
        or w2_scales.shape != (rows, hidden, inter // GROUP)
        or w2_row_scales.shape != (rows, hidden)
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(
            f"fused_experts_nvfp4: x {tuple(x.shape)}, w13 {tuple(w13_packed.shape)}/{tuple(w13_scales.shape)}, "
            f"w2 {tuple(w2_packed.shape)}/{tuple(w2_scales.shape)}, ids {tuple(topk_ids.shape)} disagree"
        )
    expert_slots = checked_slots("fused_experts_nvfp4", expert_slots)
    out = new_empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    topk_weights = topk_weights.contiguous()
    num_pairs = num_tokens * top_k
    order, offsets = moe_sort_tokens(topk_ids, rows if expert_slots is None else expert_slots.shape[0])
    # Expert strides as given (an offloaded layer's cache slots are views of one span a slot).
    w13 = (expert_major(w13_packed), expert_major(w13_scales).view(torch.uint8), expert_major(w13_row_scales))
    w2 = (expert_major(w2_packed), expert_major(w2_scales).view(torch.uint8), expert_major(w2_row_scales))
    h = new_empty((num_pairs, inter), x.dtype, x.device)
    gate_up_nvfp4(x, w13, order, offsets, h, top_k, configs[0], expert_slots)
    y = new_empty((num_pairs, hidden), x.dtype, x.device)
    down_nvfp4(h, w2, order, offsets, topk_weights, y, configs[1], expert_slots)
    sum_choices(y, out, top_k)
    return out
