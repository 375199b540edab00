"""The GEMV with the Gated DeltaNet output norm in its prologue against its reference and against
the two launches it replaces (the Triton gated norm, then the Triton GEMV)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close
from freetoken.kernels.gated_norm_gemv import gated_rms_norm_gemv_reference
from freetoken.kernels.gemv_configs import NORMED_MAX_ROWS, GemvConfig

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def operands(rng, rows: int, heads: int, head_dim: int, n_out: int, dtype: torch.dtype):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=rng) * scale).to(dtype).to(DEVICE)

    k_in = heads * head_dim
    # The core and gate as the layer passes them: the gate a strided view of a wider projection.
    core = randn(rows, heads, head_dim)
    z = randn(rows, k_in + 7)[:, 3 : 3 + k_in].reshape(rows, heads, head_dim)
    return core, z, randn(head_dim, scale=0.5) + 1, randn(n_out, k_in, scale=k_in**-0.5)


def unfused(core, z, nw, activation, w, config):
    from freetoken.kernels.triton import gemv, norm

    normed = norm.gated_rms_norm(core, z, nw, EPS, activation)
    return gemv.gemv_tiled(normed.reshape(core.shape[0], -1), w, config)


# Launch shapes: one weight row a warp and one head a step; several rows a warp and heads a step;
# a step past the row's columns (one step, partial).
CONFIGS = [GemvConfig(1, 16, 1), GemvConfig(8, 64, 2), GemvConfig(4, 4096, 4), GemvConfig(64, 256, 4)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("rows,heads,head_dim,n_out", [(1, 5, 16, 37), (3, 3, 12, 9), (NORMED_MAX_ROWS, 4, 32, 70)])
def test_gated_norm_gemv(rng, config, dtype, activation, rows, heads, head_dim, n_out):
    from freetoken.kernels.triton import gated_norm_gemv

    core, z, nw, w = operands(rng, rows, heads, head_dim, n_out, dtype)
    got = gated_norm_gemv.gated_rms_norm_gemv_tiled(core, z, nw, EPS, activation, w, config)
    assert got.dtype == dtype and got.shape == (rows, n_out)
    # The same roundings as the two launches; the GEMV's sums in another grouping.
    assert_close(got.float(), unfused(core, z, nw, activation, w, config).float(), dtype=dtype, scale=0.1)
    assert_close(got.float(), gated_rms_norm_gemv_reference(core, z, nw, EPS, activation, w).float(), dtype=dtype)


def test_gated_norm_gemv_default_launch(rng):
    from freetoken.kernels.triton import gated_norm_gemv

    core, z, nw, w = operands(rng, 2, 6, 8, 33, torch.float32)
    got = gated_norm_gemv.gated_rms_norm_gemv(core, z, nw, EPS, "silu", w)
    assert_close(got, gated_rms_norm_gemv_reference(core, z, nw, EPS, "silu", w))


def test_gated_norm_gemv_rejects_bad_operands(rng):
    from freetoken.kernels.triton import gated_norm_gemv

    core, z, nw, w = operands(rng, NORMED_MAX_ROWS + 1, 2, 8, 5, torch.float32)
    fn = gated_norm_gemv.gated_rms_norm_gemv
    with pytest.raises(ValueError, match="at most"):
        fn(core, z, nw, EPS, "silu", w)
    with pytest.raises(ValueError, match="one \\[T, H, D\\] shape"):
        fn(core[:2], z[:1], nw, EPS, "silu", w)
    with pytest.raises(ValueError, match="disagree"):
        fn(core[:2], z[:2], nw, EPS, "silu", w[:, :8])
    with pytest.raises(ValueError, match="norm_weight"):
        fn(core[:2], z[:2], nw[:4], EPS, "silu", w)
    with pytest.raises(ValueError, match="gate activation"):
        fn(core[:2], z[:2], nw, EPS, "relu", w)


def test_gated_norm_gemv_table(monkeypatch):
    from freetoken.kernels import gemv_configs

    assert gemv_configs.prefers_gated_normed_gemv(1, 2048, 4096)
    assert gemv_configs.gated_normed_gemv_config(1, 2048, 4096) == gemv_configs.GATED_NORMED_DEFAULT
    assert not gemv_configs.prefers_gated_normed_gemv(NORMED_MAX_ROWS + 1, 2048, 4096)
    entry = GemvConfig(8, 2048, 4)
    monkeypatch.setattr(gemv_configs, "GATED_NORMED_TUNED", {(2048, 4096): ((1, entry), (2, None))})
    assert gemv_configs.gated_normed_gemv_config(1, 2048, 4096) == entry
    assert not gemv_configs.prefers_gated_normed_gemv(2, 2048, 4096)  # measured slower: kept apart
    assert not gemv_configs.prefers_gated_normed_gemv(3, 2048, 4096)  # past the table's rows
