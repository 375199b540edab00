"""The GEMV with the residual add + RMSNorm in its prologue against its reference and against the
two launches it replaces (the Triton norm, then the Triton GEMV in the same launch shape)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_as_launched, assert_close
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS, GemvConfig
from freetoken.kernels.normed_gemv import add_rms_norm_gemv_reference

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _triton():
    from freetoken.kernels.triton import gemv, norm, normed_gemv

    return gemv, norm, normed_gemv


def operands(rng, rows: int, n_out: int, k_in: int, dtype: torch.dtype, residual: bool, zero_centered: bool):
    x = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE)
    res = torch.randn(rows, k_in, generator=rng).to(dtype).to(DEVICE) if residual else None
    scale = 0.2 if zero_centered else 1.0
    nw = (torch.randn(k_in, generator=rng) * scale + (0.0 if zero_centered else 1.0)).to(dtype).to(DEVICE)
    w = (torch.randn(n_out, k_in, generator=rng) * k_in**-0.5).to(dtype).to(DEVICE)
    return x, res, nw, w


def unfused(x, res, nw, zero_centered, w, config):
    """The Triton launches the fused one replaces: the norm (with the add), then the GEMV."""
    gemv, norm, _ = _triton()
    if res is None:
        normed, summed = norm.rms_norm(x, nw, EPS, zero_centered), x
    else:
        normed, summed = norm.add_rms_norm(x, res, nw, EPS, zero_centered)
    return gemv.gemv_tiled(normed, w, config), normed, summed


CONFIG = GemvConfig(64, 256, 4, pdl=False)  # the interpreter's launch shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first"])
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero_centered", "plain"])
@pytest.mark.parametrize("rows,n_out,k_in", [(1, 37, 100), (2, 65, 300), (3, 9, 48), (NORMED_MAX_ROWS, 70, 257)])
def test_normed_gemv_matches_the_two_launches(rng, dtype, residual, zero_centered, rows, n_out, k_in):
    x, res, nw, w = operands(rng, rows, n_out, k_in, dtype, residual, zero_centered)
    out, normed, summed = _triton()[2].add_rms_norm_gemv(x, res, nw, EPS, zero_centered, w, True)
    _, want_normed, want_summed = unfused(x, res, nw, zero_centered, w, CONFIG)
    assert out.dtype == dtype and out.shape == (rows, n_out)
    assert torch.equal(summed, want_summed)
    assert_as_launched(normed, want_normed)  # compiled, the row's sum of squares follows each kernel's tile
    assert_as_launched(out, _triton()[0].gemv_tiled(normed, w, CONFIG))  # the GEMV launch on the same rows
    ref_out, ref_normed, ref_summed = add_rms_norm_gemv_reference(x, res, nw, EPS, zero_centered, w, True)
    assert torch.equal(summed, ref_summed)
    assert_close(normed.float(), ref_normed.float(), dtype=dtype)
    assert_close(out.float(), ref_out.float(), dtype=dtype)


# Launch shapes: one row a warp, several rows a warp, a step of several chunks, the step split over
# more warps than rows, K past one step (several steps, the last partial).
@pytest.mark.parametrize("config", [GemvConfig(1, 256, 1), GemvConfig(8, 256, 2), GemvConfig(4, 512, 4),
                                    GemvConfig(2, 256, 4), GemvConfig(16, 128, 4)], ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_normed_gemv_tiles(rng, config, dtype):
    x, res, nw, w = operands(rng, 2, 13, 600, dtype, True, True)
    out, normed, summed = _triton()[2].add_rms_norm_gemv_tiled(x, res, nw, EPS, True, w, False, config)
    want_out, _, want_summed = unfused(x, res, nw, True, w, config)
    assert normed is None
    assert torch.equal(summed, want_summed)
    assert_as_launched(out, want_out)


def test_normed_gemv_keeps_leading_dims(rng):
    x, res, nw, w = operands(rng, 4, 24, 40, torch.float32, True, True)
    out, normed, summed = _triton()[2].add_rms_norm_gemv(x.reshape(2, 2, 40), res.reshape(2, 2, 40), nw, EPS, True, w, True)
    assert out.shape == (2, 2, 24) and normed.shape == summed.shape == (2, 2, 40)
    assert_close(out.reshape(4, 24), add_rms_norm_gemv_reference(x, res, nw, EPS, True, w)[0])


def test_normed_gemv_rejects_bad_operands(rng):
    normed_gemv = _triton()[2]
    x, res, nw, w = operands(rng, NORMED_MAX_ROWS + 1, 8, 16, torch.float32, True, True)
    with pytest.raises(ValueError, match="at most"):
        normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w)
    with pytest.raises(ValueError, match="residual shape"):
        normed_gemv.add_rms_norm_gemv(x[:2], res[:1], nw, EPS, True, w)
    with pytest.raises(ValueError, match="norm_weight"):
        normed_gemv.add_rms_norm_gemv(x[:2], res[:2], nw[:8], EPS, True, w)
    with pytest.raises(ValueError, match="disagree"):
        normed_gemv.add_rms_norm_gemv(x[:2], res[:2], nw, EPS, True, w[:, :8])
    with pytest.raises(ValueError, match="plain norm"):
        normed_gemv.add_rms_norm_gemv(x[:2], res[:2], nw.bfloat16(), EPS, False, w)


def test_normed_gemv_takes_the_gemv_rows_and_fma_shapes(monkeypatch):
    from freetoken.kernels import gemv_configs

    fma, dot = GemvConfig(2, 2048, 2), GemvConfig(64, 128, 4, 3, dot=True)
    monkeypatch.setattr(gemv_configs, "TUNED", {(512, 2048): ((1, fma), (2, dot), (4, None))})
    assert gemv_configs.prefers_normed_gemv(1, 512, 2048) and gemv_configs.normed_gemv_config(1, 512, 2048) == fma
    # The GEMV's tensor-core entry: the fused kernel (FMA only) takes its default shape.
    assert gemv_configs.normed_gemv_config(2, 512, 2048) == gemv_configs.default_config(512, 2048)
    assert not gemv_configs.prefers_normed_gemv(3, 512, 2048)  # cuBLAS there: the norm stays apart
    assert not gemv_configs.prefers_normed_gemv(NORMED_MAX_ROWS + 1, 9216, 2048)
    fused = GemvConfig(8, 2048, 2)
    monkeypatch.setattr(gemv_configs, "NORMED_TUNED", {(512, 2048): ((1, fused), (2, None))})
    assert gemv_configs.normed_gemv_config(1, 512, 2048) == fused
    assert not gemv_configs.prefers_normed_gemv(2, 512, 2048)  # the fused sweep measured it slower
    monkeypatch.setattr(gemv_configs, "NORMED_TUNED", {(512, 2048): ((1, fused),)})
    assert gemv_configs.prefers_normed_gemv(2, 512, 2048)  # past the swept rows: the GEMV's entry
    assert gemv_configs.normed_gemv_config(2, 512, 2048) == gemv_configs.default_config(512, 2048)


def test_normed_gemv_stores_float32_logits(rng):
    """``out_dtype=float32`` (the lm_head): the bf16 launch's output, converted, with no launch of its own."""
    normed_gemv = _triton()[2]
    x, res, nw, w = operands(rng, 2, 45, 96, torch.bfloat16, True, True)
    got = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w, False, torch.float32)
    want = normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0].float()) and torch.equal(got[2], want[2])
    ref_out = add_rms_norm_gemv_reference(x, res, nw, EPS, True, w, False, torch.float32)[0]
    assert ref_out.dtype == torch.float32
    assert_close(got[0], ref_out, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        normed_gemv.add_rms_norm_gemv(x, res, nw, EPS, True, w, False, torch.float16)


@pytest.mark.parametrize("config", [GemvConfig(1, 256, 1), GemvConfig(8, 128, 2), GemvConfig(64, 256, 4)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 4), (3, 3), (NORMED_MAX_ROWS, 4)])
def test_normed_gemv_conv(rng, config, dtype, rows, width):
    """The GDN input launch: its projection, sum and conv step exactly the fused launch's then
    ``causal_conv1d_decode``'s (the conv channels ending inside a program's rows), the slots' states
    moved on alike, and the reference's."""
    from freetoken.kernels.normed_gemv import add_rms_norm_gemv_conv_reference
    from freetoken.kernels.triton import conv1d

    normed_gemv = _triton()[2]
    n_out, channels, k_in, num_slots = 45, 37, 120, 6
    x, res, nw, w = operands(rng, rows, n_out, k_in, dtype, True, True)
    conv_w = (torch.randn(channels, width, generator=rng) * 0.5).to(dtype).to(DEVICE)
    state = torch.randn(num_slots, channels, width - 1, generator=rng).to(dtype).to(DEVICE)
    slots = torch.randperm(num_slots, generator=rng)[:rows].to(torch.int32).to(DEVICE)
    got_state, want_state, ref_state = state.clone(), state.clone(), state.clone()
    out, conv, summed = normed_gemv.add_rms_norm_gemv_conv_tiled(x, res, nw, EPS, True, w, conv_w, got_state, slots,
                                                                config)
    want_out, _, want_summed = normed_gemv.add_rms_norm_gemv_tiled(x, res, nw, EPS, True, w, False, config)
    want_conv = conv1d.causal_conv1d_decode(want_out[:, :channels], conv_w, want_state, slots)
    assert torch.equal(summed, want_summed)
    for got, want in ((out, want_out), (conv, want_conv), (got_state, want_state)):
        assert_as_launched(got, want)
    ref_out, ref_conv, _ = add_rms_norm_gemv_conv_reference(x, res, nw, EPS, True, w, conv_w, ref_state, slots)
    assert_close(out.float(), ref_out.float(), dtype=dtype)
    assert_close(conv.float(), ref_conv.float(), dtype=dtype)
    assert_close(got_state.float(), ref_state.float(), dtype=dtype)


def test_normed_gemv_conv_rejects_bad_operands(rng):
    normed_gemv = _triton()[2]
    x, res, nw, w = operands(rng, 2, 9, 16, torch.float32, True, True)
    conv_w = torch.randn(6, 4).to(DEVICE)
    state = torch.zeros(3, 6, 3, device=DEVICE)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    fn = normed_gemv.add_rms_norm_gemv_conv
    with pytest.raises(ValueError, match="disagree"):
        fn(x, res, nw, EPS, True, w, torch.randn(10, 4).to(DEVICE), state, slots)  # more channels than outputs
    with pytest.raises(ValueError, match="disagree"):
        fn(x, res, nw, EPS, True, w, conv_w, state[:, :, :2], slots)
    with pytest.raises(ValueError, match="disagree"):
        fn(x, res, nw, EPS, True, w, conv_w, state, slots[:1])
