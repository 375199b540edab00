"""NVFP4 weight rows against a few activation rows without tensor cores (W4A16 decode).

One activation row has no tensor-core work: the codes are turned into float32 ``e2m1 · 2^-6``
(``_code_values``), multiplied with the activations, summed per group of 16 and the group sums
scaled (``_row_dots``). Used by the NVFP4 MoE decode block (``nvfp4_decode.py``) and by
``nvfp4_linear`` for decode-sized batches (``nvfp4_gemv``): each program streams whole packed
rows (2048 weights a load) so that many bytes are in flight at one token. Under programmatic
dependent launch (sm_90 on) the GEMV loads its first weight step before waiting for the previous
launch, as ``gemv.py``'s does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton._common import _INTERPRETED, INTERPRETED, cast, device_function, pow2
from freetoken.kernels.triton.moe_decode import _pdl_available


@device_function
def _e4m3_codes(packed):
    """uint8 codes ``[..., C]`` -> e4m3 bytes ``[..., C, 2]`` (the even column first) that are
    ``e2m1 · 2^-6`` (see ``nvfp4._decode_tile``): sign to bit 7, exponent and mantissa to bits 4-2."""
    lo = ((packed & 0x08) << 4) | ((packed & 0x07) << 2)  # the even column
    hi = (packed & 0x80) | ((packed & 0x70) >> 2)
    return tl.join(lo, hi)


# One 32-bit register of 4 packed bytes -> the 4 even (low-nibble) or odd (high-nibble) codes as
# float32 ``e2m1 · 2^-6``: the nibbles' bits moved into e4m3 bytes for all 4 bytes at once (as
# ``_e4m3_codes`` does one byte at a time), then the hardware e4m3x2 -> f16x2 conversion.
_CODES_TO_FLOAT = """{
.reg .b32 t, e, p0, p1;
.reg .b16 lo, hi, h0, h1, h2, h3;
%s
mov.b32 {lo, hi}, e;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
mov.b32 {h0, h1}, p0;
mov.b32 {h2, h3}, p1;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}"""
_EVEN_TO_FLOAT = tl.constexpr(_CODES_TO_FLOAT % "shl.b32 t, $4, 4;\nand.b32 t, t, 0x80808080;\nshl.b32 e, $4, 2;\nand.b32 e, e, 0x1C1C1C1C;\nor.b32 e, e, t;")
_ODD_TO_FLOAT = tl.constexpr(_CODES_TO_FLOAT % "shr.b32 t, $4, 2;\nand.b32 t, t, 0x1C1C1C1C;\nand.b32 e, $4, 0x80808080;\nor.b32 e, e, t;")


# One 32-bit register of 4 packed bytes -> the 4 even or odd codes as exact bf16 ``e2m1`` in two
# bf16x2 registers (elements 0, 1 and 2, 3): two bytes spread to the halves (prmt: the low bytes for
# the even codes, the high bytes for the odd ones, whose sign bit is then already bit 15), the
# exponent / mantissa to bits 8-6, which is ``e2m1 · 2^-126`` for all 16 codes (0.5 a bf16
# subnormal), then one ``mul.bf16x2`` by 2^126 (0x7E80) a pair, as Marlin does.
_CODES_TO_BF16 = """{
.reg .b32 z, t, a, c, bias;
mov.b32 z, 0;
mov.b32 bias, 0x7E807E80;
prmt.b32 t, $2, z, %s;
%s
mul.rn.bf16x2 $0, a, bias;
prmt.b32 t, $2, z, %s;
%s
mul.rn.bf16x2 $1, a, bias;
}"""
_EVEN_BITS = "shl.b32 a, t, 12;\nand.b32 a, a, 0x80008000;\nshl.b32 c, t, 6;\nand.b32 c, c, 0x01C001C0;\nor.b32 a, a, c;"
_ODD_BITS = "and.b32 a, t, 0x80008000;\nshr.b32 c, t, 6;\nand.b32 c, c, 0x01C001C0;\nor.b32 a, a, c;"
_EVEN_TO_BF16 = tl.constexpr(_CODES_TO_BF16 % ("0x4140", _EVEN_BITS, "0x4342", _EVEN_BITS))
_ODD_TO_BF16 = tl.constexpr(_CODES_TO_BF16 % ("0x1404", _ODD_BITS, "0x3424", _ODD_BITS))


@device_function
def _code_bf16(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Compiled only (inline PTX): uint8 codes ``[BLOCK_N, BLOCK_K / 2]`` -> bf16 ``[BLOCK_N, BLOCK_K]``
    exact ``e2m1`` values, about 1.5 instructions a weight (``nvfp4._decode_tile``'s fast path)."""
    even = tl.inline_asm_elementwise(_EVEN_TO_BF16, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
    odd = tl.inline_asm_elementwise(_ODD_TO_BF16, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4)
    return tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))


@device_function
def _code_values(packed):
    """uint8 codes ``[..., C]`` -> float32 ``(even columns, odd columns)``, each ``[..., C]``, of
    values ``e2m1 · 2^-6``.

    Compiled, the nibbles are moved a 32-bit word (8 codes) at a time, about one integer
    instruction a weight where Triton's byte-wise ops (``_e4m3_codes``) take six; the
    interpreter, which runs no PTX, takes the byte-wise path (the same values)."""
    if _INTERPRETED:
        even, odd = tl.split(_e4m3_codes(packed))
        even = even.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        odd = odd.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        even = tl.inline_asm_elementwise(_EVEN_TO_FLOAT, "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4)
        odd = tl.inline_asm_elementwise(_ODD_TO_FLOAT, "=r,=r,=r,=r,r", [packed], dtype=tl.float32, is_pure=True, pack=4)
    return even, odd


@device_function
def _row_dots(packed, scale_bytes, xv, B: tl.constexpr, BLOCK_K: tl.constexpr):
    """Float32 ``[A, B]`` dot products, before the row scale, of NVFP4 row tiles (uint8 codes
    ``[A, B, BLOCK_K / 2]``, e4m3 scale bytes ``[A, B, BLOCK_K / 16]``) with float32 activations
    ``xv`` (``[A or 1, 1, BLOCK_K]``; ``[M, 1, BLOCK_K]`` with ``A = 1``: ``[M, B]``, M rows against one tile).

    The codes decode as ``e2m1 · 2^-6`` (``_code_values``, as ``nvfp4._decode_tile``); their products
    with the activations are summed per group and the group sums times ``scale · 2^6``: exact
    products (bf16 activations), sums that differ from the reference's order only in float32
    rounding. ``xv`` should come from a 2-D load expanded here: loaded 3-D, its layout differs from
    the weights' and Triton moves every decoded weight through shared memory to meet it."""
    even, odd = _code_values(packed)
    values = tl.reshape(tl.join(even, odd), (packed.shape[0], B, BLOCK_K))
    products = values * xv
    groups = tl.sum(tl.reshape(products, (products.shape[0], B, BLOCK_K // 16, 16)), 3)
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
    return tl.sum(groups * scales, 2)


@device_function
def _gemv_step(acc, w, s, k0, x_ptr, x_st, m, m_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N] +=`` the packed step ``w`` / ``s`` against the rows' columns ``k0 ..``."""
    k = k0 + tl.arange(0, BLOCK_K)
    xv = tl.load(x_ptr + m[:, None] * x_st + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
    return acc + _row_dots(w, s, xv.to(tl.float32)[:, None, :], BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_kernel(
    x_ptr, x_st, w_ptr, s_ptr, r_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the next launch may start: its programs take the slots these leave
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    # The weight tiles loaded 3-D as _row_dots reduces them, the activations 2-D and expanded: the
    # other combinations make Triton convert layouts through shared memory (see _row_dots).
    rows = n.to(tl.int64)[None, :, None]
    rows_ok = n_ok[None, :, None]
    half = tl.arange(0, BLOCK_K // 2)
    group = tl.arange(0, BLOCK_K // 16)
    # The first weight step is loaded before the wait: the model never writes its weights.
    w = tl.load(w_ptr + rows * (K // 2) + half[None, None, :], mask=rows_ok & (half < K // 2)[None, None, :], other=0)
    s = tl.load(s_ptr + rows * (K // 16) + group[None, None, :], mask=rows_ok & (group < K // 16)[None, None, :],
                other=0)
    if PDL:  # x is the previous launch's output
        tl.extra.cuda.gdc_wait()
    acc = _gemv_step(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), w, s, 0, x_ptr, x_st, m, m_ok, K, BLOCK_N, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptr + rows * (K // 2) + (k0 // 2 + half)[None, None, :],
                    mask=rows_ok & (k0 // 2 + half < K // 2)[None, None, :], other=0)
        s = tl.load(s_ptr + rows * (K // 16) + (k0 // 16 + group)[None, None, :],
                    mask=rows_ok & (k0 // 16 + group < K // 16)[None, None, :], other=0)
        acc = _gemv_step(acc, w, s, k0, x_ptr, x_st, m, m_ok, K, BLOCK_N, BLOCK_K)
    out = acc * tl.load(r_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * N + n[None, :], cast(out, out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# Up to this many activation rows ``nvfp4_linear`` takes the GEMV: each row adds one FFMA a weight to
# the ~5.5 SASS instructions of its decode, against ~12 for the tensor-core tile's (nvfp4_sass.py).
GEMV_MAX_ROWS = 4


def _gemv_tiles(n_out: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): whole 2048-weight packed row segments, 16 rows a program where
    the rows give over 256 programs, else 8 (the interpreter's cost is per program: 64)."""
    if INTERPRETED:
        return 64, 2048, 4
    return (16, 2048, 8) if n_out > 4096 else (8, 2048, 4)


def nvfp4_gemv(rows: torch.Tensor, packed: torch.Tensor, scale_bytes: torch.Tensor, row_scales: torch.Tensor,
               out: torch.Tensor) -> None:
    """``out = rows @ W.T`` for at most ``GEMV_MAX_ROWS`` rows (unit column stride) of the NVFP4 weight
    ``W [N, K]`` (contiguous ``packed``, ``scale_bytes`` as uint8, ``row_scales``)."""
    num_rows, k_in = rows.shape
    n_out = packed.shape[0]
    block_n, block_k, warps = _gemv_tiles(n_out)
    pdl = _pdl_available()
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        rows, rows.stride(0), packed, scale_bytes, row_scales, out, num_rows, n_out, k_in,
        BLOCK_M=pow2(num_rows), BLOCK_N=block_n, BLOCK_K=min(pow2(k_in), block_k), PDL=pdl,
        num_warps=warps, launch_pdl=pdl,
    )


# One 32-bit word of packed codes (8 columns) -> its 8 codes as float32 ``e2m1 · 2^-6``, in the order
# of ``WORD_COLUMNS``: the even (low-nibble) codes of bytes 0-3, then the odd ones; the bit moves of
# ``_EVEN_TO_FLOAT`` / ``_ODD_TO_FLOAT`` on the whole word, then the hardware e4m3x2 -> f16x2.
_WORD_TO_FLOAT = tl.constexpr("""{
.reg .b32 t, e, p0, p1, p2, p3;
.reg .b16 lo, hi, h0, h1, h2, h3, h4, h5, h6, h7;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
shl.b32 e, $8, 2;
and.b32 e, e, 0x1C1C1C1C;
or.b32 e, e, t;
mov.b32 {lo, hi}, e;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
shr.b32 t, $8, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 e, $8, 0x80808080;
or.b32 e, e, t;
mov.b32 {lo, hi}, e;
cvt.rn.f16x2.e4m3x2 p2, lo;
cvt.rn.f16x2.e4m3x2 p3, hi;
mov.b32 {h0, h1}, p0;
mov.b32 {h2, h3}, p1;
mov.b32 {h4, h5}, p2;
mov.b32 {h6, h7}, p3;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
cvt.f32.f16 $4, h4;
cvt.f32.f16 $5, h5;
cvt.f32.f16 $6, h6;
cvt.f32.f16 $7, h7;
}""")
# The column within its word of each of ``_word_values``' 8 outputs.
WORD_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)


@device_function
def _word_code(words, SHIFT: tl.constexpr):
    """The code at bits ``SHIFT`` to ``SHIFT + 3`` of every int32 word as float32 ``e2m1 · 2^-6``
    (byte-wise, as ``_e4m3_codes``: the interpreter's path of ``_word_values``)."""
    q = (words >> SHIFT) & 0xF
    return (((q & 0x8) << 4) | ((q & 0x7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@device_function
def _word_values(words):
    """int32 words of packed codes ``[...]`` -> 8 float32 tensors ``[...]`` of values ``e2m1 · 2^-6``,
    the word's columns ``WORD_COLUMNS``. Compiled: one inline-PTX block a word; taking words, not
    bytes, a kernel can hold packed tiles across loop iterations in 32-bit registers (byte tensors
    are carried one byte a register and repacked before every decode)."""
    if _INTERPRETED:
        return (_word_code(words, 0), _word_code(words, 8), _word_code(words, 16), _word_code(words, 24),
                _word_code(words, 4), _word_code(words, 12), _word_code(words, 20), _word_code(words, 28))
    else:
        return tl.inline_asm_elementwise(_WORD_TO_FLOAT, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@device_function
def _word_dots(words, scale_bytes, x0, x1, x2, x3, x4, x5, x6, x7, B: tl.constexpr, W: tl.constexpr):
    """``_row_dots`` on int32 words: float32 ``[A, B]`` dot products, before the row scale, of NVFP4
    row tiles (words ``[A, B, W]``, 8 codes each, two words a scale group; e4m3 scale bytes
    ``[A, B, W / 2]``) with float32 activations ``x0 .. x7`` (``[A or 1, 1, W]``: each word's columns
    ``WORD_COLUMNS``, in that order)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(words)
    per_word = v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7
    groups = tl.sum(tl.reshape(per_word, (words.shape[0], B, W // 2, 2)), 3)
    scales = scale_bytes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
    return tl.sum(groups * scales, 2)
