from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from kernel_checks import DEVICE, assert_close
from freetoken.kernels import moe as moe_ref
from freetoken.kernels import nvfp4 as ref
from freetoken.kernels.triton.nvfp4_rows import WORD_COLUMNS, _word_values  # after conftest picked the interpreter


def _triton():
    from freetoken.kernels.triton import nvfp4

    return nvfp4


def random_nvfp4(rng: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes (every byte value), e4m3 scales over normal and subnormal values, and row scales
    scaled so that the weights are about ``1 / sqrt(in)``."""
    *lead, rows, cols = shape
    packed = torch.randint(0, 256, (*lead, rows, cols // 2), generator=rng, dtype=torch.uint8)
    scale_bytes = torch.randint(0, 0x7F, (*lead, rows, cols // 16), generator=rng, dtype=torch.uint8)  # no NaN
    scales = scale_bytes.view(torch.float8_e4m3fn)
    row_scales = torch.rand(*lead, rows, generator=rng) * 2**-6 * cols**-0.5 + 1e-4
    return packed.to(DEVICE), scales.to(DEVICE), row_scales.to(DEVICE)


def float32_reference(reference, *args):
    """``reference`` on the float32 copies of the half-precision arguments: what a bf16 kernel is
    held to. The kernels keep ``e2m1 · e4m3`` exact and scale the float32 accumulator by the row
    scale, while the reference in bf16 rounds every dequantized weight first, so comparing the two
    adds both errors (past 1e-2 for one token through three experts, in about 1 of 12 draws)."""
    half = (torch.bfloat16, torch.float16)
    return reference(*(a.float() if isinstance(a, torch.Tensor) and a.dtype in half else a for a in args))


def assert_close_to_float32(got, reference, *args, scale: float = 1.0):
    assert_close(got.float(), float32_reference(reference, *args), dtype=got.dtype, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Row counts and widths that pick each path: the GEMV (up to 4 rows; its K loop past one 2048-step),
# then the compiled kernel's tile shapes (decode, 64-row, 128-row tiles).
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 37, 48), (2, 4112, 16), (4, 9, 4112), (5, 40, 16), (33, 40, 32),
                                             (67, 24, 272)])
def test_nvfp4_linear(rng, dtype, rows, n_out, k_in):
    packed, scales, row_scales = random_nvfp4(rng, n_out, k_in)
    x = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE)
    got = _triton().nvfp4_linear(x, packed, scales, row_scales)
    assert_close_to_float32(got, ref.nvfp4_linear_reference, x, packed, scales, row_scales)


def test_nvfp4_linear_keeps_leading_dims(rng):
    packed, scales, row_scales = random_nvfp4(rng, 24, 32)
    x = torch.randn(2, 3, 32, generator=rng).to(DEVICE)
    assert_close(_triton().nvfp4_linear(x, packed, scales, row_scales), ref.nvfp4_linear_reference(x, packed, scales, row_scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37, 150])
def test_fused_experts_nvfp4(rng, dtype, tokens):
    e, k, hidden, inter = 7, 3, 80, 48
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    w13 = random_nvfp4(rng, e, 2 * inter, hidden)
    w2 = random_nvfp4(rng, e, hidden, inter)
    logits = torch.randn(tokens, e, generator=rng).to(dtype).to(DEVICE)
    weights, ids = moe_ref.moe_topk_softmax_reference(logits, k, True)
    got = _triton().fused_experts_nvfp4(x, *w13, *w2, weights, ids)
    assert_close_to_float32(got, ref.fused_experts_nvfp4_reference, x, *w13, *w2, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_decodes_every_code_and_scale(dtype):
    """The kernel's in-register decode (nibbles as e4m3 codes, the hardware fp8 conversion, the
    scale product in ``dtype``) against torch's e2m1 table and e4m3 cast: a GEMM with one-hot
    inputs reads the weights back, bit-exact (in bf16 too: ``e2m1 · e4m3`` is exact there)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 1)  # [4, 256]: every byte in every row
    scale_bytes = torch.arange(128, dtype=torch.uint8).view(4, 32)  # every e4m3 code but NaN (127)
    scale_bytes[3, 31] = 0x7E
    scales = scale_bytes.view(torch.float8_e4m3fn)
    row_scales = torch.tensor([1.0, 0.5, 2.0, 0.25])
    packed, scales, row_scales = codes.to(DEVICE), scales.to(DEVICE), row_scales.to(DEVICE)
    eye = torch.eye(512, device=DEVICE, dtype=dtype)
    got = _triton().nvfp4_linear(eye, packed, scales, row_scales).T
    assert torch.equal(got, ref.dequantize_nvfp4(packed, scales, row_scales, dtype))


def _decode_block_inputs(rng, dtype, tokens, e, hidden, inter, shared_inter):
    x = torch.randn(tokens, hidden, generator=rng).to(dtype).to(DEVICE)
    # Distinct router logits in every row (exact in bf16): torch.topk leaves the order of ties unspecified.
    router = torch.stack([torch.randperm(e, generator=rng) for _ in range(tokens)]) * 0.25 - 1.5
    logits = torch.cat([router, torch.randn(tokens, 1, generator=rng)], dim=1).to(dtype).to(DEVICE)
    weights = (
        *random_nvfp4(rng, e, 2 * inter, hidden), *random_nvfp4(rng, e, hidden, inter),
        *random_nvfp4(rng, 2 * shared_inter, hidden), *random_nvfp4(rng, hidden, shared_inter),
    )
    return x, logits, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_decodes_every_code_and_scale(dtype):
    """The GEMV's decode (codes a word at a time where compiled, group sums scaled after) reads one
    column at a time back bit-exact: one-hot rows select the even and the odd nibble of every byte
    value, under every e4m3 scale but NaN."""
    rows = torch.arange(512)
    packed = (rows % 256).to(torch.uint8)[:, None].repeat(1, 8).to(DEVICE)  # [512, 8]: K = 16
    scales = (rows % 127).to(torch.uint8)[:, None].view(torch.float8_e4m3fn).to(DEVICE)
    row_scales = torch.tensor([1.0, 0.5, 2.0, 0.25]).repeat(128).to(DEVICE)
    one_hot = torch.eye(16, device=DEVICE, dtype=dtype)[:2]
    got = _triton().nvfp4_linear(one_hot, packed, scales, row_scales)
    assert torch.equal(got, ref.dequantize_nvfp4(packed, scales, row_scales, dtype)[:, :2].T)


@triton.jit
def _word_values_kernel(words_ptr, out_ptr, N: tl.constexpr):
    """``nvfp4_rows._word_values`` of ``N`` int32 words stored as ``[N, 8]`` in column order."""
    i = tl.arange(0, N)
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(tl.load(words_ptr + i))
    row = out_ptr + i * 8
    tl.store(row, v0)
    tl.store(row + 2, v1)
    tl.store(row + 4, v2)
    tl.store(row + 6, v3)
    tl.store(row + 1, v4)
    tl.store(row + 3, v5)
    tl.store(row + 5, v6)
    tl.store(row + 7, v7)


def test_word_decode_reads_every_code_in_every_byte():
    """The stream kernels' decode of a 32-bit word (inline PTX where compiled, byte-wise under the
    interpreter) gives ``e2m1 · 2^-6`` of all 8 codes in ``WORD_COLUMNS`` order, bit-exact: every
    byte value in each of the word's four bytes."""
    assert sorted(WORD_COLUMNS) == list(range(8))
    values = torch.arange(256)
    packed = torch.stack([(values + 64 * b) % 256 for b in range(4)], dim=1).to(torch.uint8)  # [256 words, 4 bytes]
    out = torch.empty(256, 8, device=DEVICE)
    _word_values_kernel[(1,)](packed.to(DEVICE).view(torch.int32).view(-1), out, N=256)
    # Two words a row make one group of 16 columns, at scale 1 (e4m3 0x38) and row scale 1.
    ones = torch.full((128, 1), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = ref.dequantize_nvfp4(packed.view(128, 8), ones, torch.ones(128), torch.float32).view(256, 8)
    assert torch.equal(out.cpu() * 64, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_sparse_moe_decode_nvfp4(rng, dtype, tokens):
    """The few-token MoE block over NVFP4 routed and shared experts (shared intermediate wider than
    the routed one, so the h rows are padded) against the general ops it replaces."""
    e, k, hidden, inter, shared_inter = 7, 3, 80, 32, 48
    x, logits, weights = _decode_block_inputs(rng, dtype, tokens, e, hidden, inter, shared_inter)
    from freetoken.kernels.triton import nvfp4_decode

    got = nvfp4_decode.sparse_moe_decode_nvfp4(x, logits, *weights, k, True)
    assert_close_to_float32(got, ref.sparse_moe_decode_nvfp4_reference, x, logits, *weights, k, True)


# Launch shapes the tuner may pick, at sizes that leave ragged edges: pairs per gate/up program not
# dividing the 9 pairs, row blocks not dividing the rows, reduction steps of one group, below and
# above the reduced dimension; programmatic dependent launch on and off (compiled for sm_90 on only).
NVFP4_TILE_CASES = [
    dict(gate_up_block_n=8, gate_up_block_k=16, gate_up_warps=2, down_block_n=16, down_block_k=16, down_warps=2),
    dict(gate_up_block_n=4, gate_up_block_k=32, gate_up_pairs=2, down_block_n=8, down_block_k=32),
    dict(gate_up_block_n=2, gate_up_block_k=4096, gate_up_pairs=16, down_block_n=2, down_block_k=4096, down_warps=1,
         pdl=False),
    # The stream kernels (nvfp4_decode_stream): one program a token on the interpreter's one "SM" or
    # several, looping over tiles that do not divide the rows, prefetching or not, beside a
    # one-program-per-tile pass.
    dict(gate_up_per_sm=2, down_per_sm=3, gate_up_block_n=4, down_block_n=16, gate_up_warps=2, down_warps=2),
    dict(gate_up_per_sm=1, down_per_sm=1, prefetch=False, gate_up_block_n=32, down_block_n=32),
    dict(gate_up_per_sm=7, down_per_sm=5, pdl=False, gate_up_block_n=8, down_block_n=4),
    dict(gate_up_per_sm=2, gate_up_block_n=16, down_block_n=8, gate_up_regs=128),
    # The shared expert's tiles first, some programs' first tile loaded before the routing: programs
    # fewer than, equal to and more than its tiles.
    dict(gate_up_per_sm=2, gate_up_block_n=16, down_block_n=8, shared_first=True),
    dict(gate_up_per_sm=3, gate_up_block_n=16, shared_first=True, down_per_sm=2, prefetch=False),
    dict(gate_up_per_sm=9, gate_up_block_n=4, shared_first=True, down_per_sm=2, down_block_n=4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", NVFP4_TILE_CASES,
                         ids=lambda t: "-".join(f"{v}" for v in t.values()))
def test_sparse_moe_decode_nvfp4_tiles(rng, dtype, tiles):
    """Every launch shape gives the reference's result; shared_inter above inter, so the shared
    expert's rows run past the routed ones' in both passes, and not renormalized."""
    from freetoken.kernels.triton import nvfp4_decode

    e, k, hidden, inter, shared_inter = 6, 2, 48, 16, 48
    x, logits, weights = _decode_block_inputs(rng, dtype, 3, e, hidden, inter, shared_inter)
    got = nvfp4_decode.sparse_moe_decode_nvfp4_tiled(x, logits, *weights, k, False, nvfp4_decode.NVFP4DecodeTiles(**tiles))
    # In bf16 the block rounds its gate/up activations and each expert's down output before the sum
    # (three roundings over 144 outputs): a random draw reached 1.13x the one-rounding bound.
    assert_close_to_float32(got, ref.sparse_moe_decode_nvfp4_reference, x, logits, *weights, k, False, scale=2.0)


def test_decode_tiles_from_the_environment_text():
    from freetoken.kernels.triton.nvfp4_decode import NVFP4DecodeTiles, tiles_from_text

    assert tiles_from_text("") == NVFP4DecodeTiles()
    assert tiles_from_text(" down_per_sm=3, shared_first=True,pdl=0") == NVFP4DecodeTiles(down_per_sm=3, shared_first=True,
                                                                                         pdl=False)
    with pytest.raises(ValueError, match="not an NVFP4DecodeTiles field"):
        tiles_from_text("fused=2")
    with pytest.raises(ValueError, match="prefetch must be true or false"):
        tiles_from_text("down_per_sm=1,prefetch=yes")
    with pytest.raises(ValueError, match="down_block_n must be an integer"):
        tiles_from_text("down_block_n=four")


def test_nvfp4_decode_tiles_reject_a_step_below_one_group():
    from freetoken.kernels.triton.nvfp4_decode import NVFP4DecodeTiles

    with pytest.raises(ValueError, match="down_block_k"):
        NVFP4DecodeTiles(down_block_k=8)


def test_nvfp4_decode_tiles_reject_bad_stream_fields():
    from freetoken.kernels.triton.nvfp4_decode import NVFP4DecodeTiles

    with pytest.raises(ValueError, match="down_regs"):
        NVFP4DecodeTiles(down_regs=300)
    with pytest.raises(ValueError, match="gate_up_per_sm"):
        NVFP4DecodeTiles(gate_up_per_sm=-1)
    with pytest.raises(ValueError, match="shared_first"):
        NVFP4DecodeTiles(gate_up_per_sm=0, shared_first=True)
