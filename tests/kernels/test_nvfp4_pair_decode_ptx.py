"""The tensor-core tiles' inline-PTX decode (``nvfp4._pairs_asm``) run on the CPU by a small
interpreter of the instructions it uses, against torch's e2m1 table and e4m3 cast: every byte value
in every byte of the word, every e4m3 scale but NaN. The interpreter tests of the kernels take the
byte-wise path (no PTX there), and the GPU tests check the compiled PTX; this checks the text itself
(selectors, masks, shifts, the subnormal 0.5) where no GPU is."""

from __future__ import annotations

import re
import struct

import torch

from freetoken.kernels import nvfp4 as ref


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_bits(value: float) -> int:
    """A float exactly representable in bf16 (every product here is) as its bits."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0, value
    return bits >> 16


def _mul_bf16x2(a: int, b: int) -> int:
    halves = [_to_bf16_bits(_bf16(a >> s) * _bf16(b >> s)) for s in (0, 16)]
    return halves[0] | halves[1] << 16


def _prmt(a: int, b: int, selector: int) -> int:
    source = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    nibbles = [(selector >> 4 * i) & 0xF for i in range(4)]
    assert all(n < 8 for n in nibbles)  # no sign replication in these selectors
    return sum(source[n] << 8 * i for i, n in enumerate(nibbles))


def run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """Runs ``text`` (``mov``, ``shl``, ``shr``, ``and``, ``or``, ``prmt``, ``mul.rn.bf16x2`` on .b32
    registers) with ``$n`` operands bound; returns every register and operand after it."""
    regs = dict(operands)

    def value(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else int(token) if token.isdigit() else regs[token]

    for line in text.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(s) for s in src]
        result = {
            "mov.b32": lambda: v[0],
            "shl.b32": lambda: v[0] << v[1],
            "shr.b32": lambda: v[0] >> v[1],
            "and.b32": lambda: v[0] & v[1],
            "or.b32": lambda: v[0] | v[1],
            "prmt.b32": lambda: _prmt(v[0], v[1], v[2]),
            "mul.rn.bf16x2": lambda: _mul_bf16x2(v[0], v[1]),
        }[op]()
        regs[dst] = result & 0xFFFFFFFF
    return regs


def _words() -> torch.Tensor:
    """[256, 4] bytes: ``(2b + 1)·v + 17·b`` in byte b of word v (odd multipliers: each byte sees all
    256 values), so the four bytes of a word differ in both nibbles and a byte taken for another fails."""
    values = torch.arange(256)
    return torch.stack([((2 * b + 1) * values + 17 * b) % 256 for b in range(4)], dim=1).to(torch.uint8)


def _decode(asm: str, word: torch.Tensor, scale_pair: int | None) -> list[float]:
    operands = {"$4": int.from_bytes(bytes(word.tolist()), "little")}
    if scale_pair is not None:
        operands["$5"] = operands["$6"] = scale_pair
    regs = run_ptx(asm, operands)
    return [_bf16(regs[f"${out}"] >> shift) for out in range(4) for shift in (0, 16)]


def test_pair_decode_ptx_reads_every_code():
    from freetoken.kernels.triton.nvfp4 import _PAIRS_TO_BF16

    asm = _PAIRS_TO_BF16.value
    assert re.search(r"\$5", asm) is None
    want = ref.unpack_e2m1(_words())  # [256 words, 8 columns]
    for word, expected in zip(_words(), want):
        got = torch.tensor(_decode(asm, word, None))
        assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_scaled_pair_decode_ptx_is_e2m1_times_e4m3_exactly():
    from freetoken.kernels.triton.nvfp4 import _SCALED_PAIRS_TO_BF16

    words = _words()
    for scale_byte in range(0x7F):  # every e4m3 value but NaN, on a spread of words
        scale = torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        s = _to_bf16_bits(scale.item())
        for word in words[scale_byte % 7 :: 37]:
            want = ref.unpack_e2m1(word) * scale
            got = torch.tensor(_decode(_SCALED_PAIRS_TO_BF16.value, word, s | s << 16))
            assert torch.equal(got, want), (scale_byte, word.tolist())


def test_folded_pair_decode_ptx_is_the_product_short_of_2_to_the_8():
    """The folded decode (``fold_bias``: no bias multiply, the scale operand ``e4m3 · 2^118``) gives
    ``e2m1 · e4m3 · 2^-8`` exactly, subnormal 0.5 codes and e4m3 subnormal scales included, and its
    text keeps no bias multiply."""
    from freetoken.kernels.triton.nvfp4 import _FOLDED_PAIRS_TO_BF16, _FOLDED_SCALE, FOLD

    asm = _FOLDED_PAIRS_TO_BF16.value
    assert "bias" not in asm and asm.count("mul.rn.bf16x2") == 4
    words = _words()
    for scale_byte in range(0x7F):
        scale = torch.tensor([scale_byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        s = _to_bf16_bits(scale.item() * _FOLDED_SCALE.value)
        for word in words[scale_byte % 5 :: 29]:
            want = ref.unpack_e2m1(word) * scale / FOLD.value
            got = torch.tensor(_decode(asm, word, s | s << 16))
            assert torch.equal(got, want), (scale_byte, word.tolist())


def test_split_decode_ptx_gives_each_byte_its_even_and_odd_value():
    """The split decode (``split``): byte i's low-nibble value is element i of the even output ($0,
    $1), its high-nibble value element i of the odd one ($2, $3), each times its own byte's scale
    (``e4m3 · 2^118`` in, ``e2m1 · e4m3 · 2^-8`` out), scales differing byte to byte."""
    from freetoken.kernels.triton.nvfp4 import _SPLIT_TO_BF16, _FOLDED_SCALE, FOLD

    asm = _SPLIT_TO_BF16.value
    e4m3 = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for i, word in enumerate(_words()):
        scales = e4m3[[(i + 31 * b) % 0x7F for b in range(4)]]  # subnormal scales among them
        bits = [_to_bf16_bits(v.item() * _FOLDED_SCALE.value) for v in scales]
        operands = {"$4": int.from_bytes(bytes(word.tolist()), "little"),
                    "$5": bits[0] | bits[1] << 16, "$6": bits[2] | bits[3] << 16}
        regs = run_ptx(asm, operands)
        got = torch.tensor([_bf16(regs[f"${out}"] >> shift) for out in range(4) for shift in (0, 16)])
        values = ref.unpack_e2m1(word).view(4, 2) * scales[:, None] / FOLD.value  # [byte, (even, odd)]
        assert torch.equal(got, torch.cat((values[:, 0], values[:, 1]))), (i, word.tolist())
