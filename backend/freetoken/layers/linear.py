"""Linear layers over dense or NVFP4 weights: every projection and the routed experts call these,
so a checkpoint's quantized linears stay packed in memory and nothing else in the model changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import kernels
from freetoken.kernels.gemv import GEMV_DTYPES
from freetoken.kernels.gemv_configs import prefers_gemv
from freetoken.kernels.nvfp4 import GROUP_SIZE, dequantize_nvfp4


class NVFP4Weight(nn.Module):
    """A weight ``[*, out, in]`` (a linear's, or a stack of experts') kept as NVFP4 (see
    ``kernels/nvfp4.py``): ``packed`` uint8 ``[*, out, in/2]``, ``scales`` e4m3 ``[*, out, in/16]``,
    ``row_scales`` float32 ``[*, out]``. Loading replaces a dense parameter with one of these."""

    def __init__(self, shape: torch.Size | tuple[int, ...], device: torch.device) -> None:
        super().__init__()
        *lead, rows, cols = shape
        if cols % GROUP_SIZE:
            raise ValueError(f"NVFP4 needs an input dim that is a multiple of {GROUP_SIZE}, got {cols}")
        self.shape = torch.Size(shape)

        def param(*dims: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*dims, dtype=dtype, device=device), requires_grad=False)

        self.packed = param(*lead, rows, cols // 2, dtype=torch.uint8)
        self.scales = param(*lead, rows, cols // GROUP_SIZE, dtype=torch.float8_e4m3fn)
        self.row_scales = param(*lead, rows, dtype=torch.float32)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scales, self.row_scales, dtype)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}"


class SplitWeight(nn.Module):
    """A fused weight whose row runs are stored differently (packed rows, then dense rows, ...):
    a checkpoint quantized some of the linears that FreeToken runs as one GEMM."""

    def __init__(self, pieces: list[NVFP4Weight | nn.Parameter]) -> None:
        super().__init__()
        self.num_pieces = len(pieces)
        for i, piece in enumerate(pieces):
            setattr(self, f"piece{i}", piece)  # registers a parameter or a module

    def pieces(self) -> list[torch.Tensor | NVFP4Weight]:
        return [getattr(self, f"piece{i}") for i in range(self.num_pieces)]

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x, piece) for piece in self.pieces()], dim=-1)


Weight = torch.Tensor | NVFP4Weight | SplitWeight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ weight.T`` for a dense, an NVFP4 or a split weight.

    A dense weight on CUDA against a few rows (decode) runs as ``kernels.gemv`` where the GEMV sweep
    found it faster than cuBLAS (``kernels/gemv_configs.py``), else through cuBLAS."""
    if isinstance(weight, NVFP4Weight):
        return kernels.nvfp4_linear(x, weight.packed, weight.scales, weight.row_scales)
    if isinstance(weight, SplitWeight):
        return weight.forward_rows(x)
    if takes_gemv(x, weight):
        return kernels.gemv(x, weight)
    return F.linear(x, weight)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        weight.is_cuda
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in GEMV_DTYPES
        and x.shape[-1] == weight.shape[1] > 0
        and prefers_gemv(x.numel() // weight.shape[1], weight.shape[0], weight.shape[1])
    )


def experts(x: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts (``kernels.fused_experts``) over dense or NVFP4 ``w13`` / ``w2``.

    A checkpoint that quantized only one of the two projections runs the other one dense: the
    quantized one is dequantized per call (slow, but exact; no released checkpoint does this).
    """
    if isinstance(w13, NVFP4Weight) and isinstance(w2, NVFP4Weight):
        return kernels.fused_experts_nvfp4(
            x, w13.packed, w13.scales, w13.row_scales, w2.packed, w2.scales, w2.row_scales, topk_weights, topk_ids
        )
    dense13 = w13.dequantize(x.dtype) if isinstance(w13, NVFP4Weight) else w13
    dense2 = w2.dequantize(x.dtype) if isinstance(w2, NVFP4Weight) else w2
    return kernels.fused_experts(x, dense13, dense2, topk_weights, topk_ids)


def sparse_moe_decode(
    x: torch.Tensor,
    gate_logits: torch.Tensor,
    w13: Weight,
    w2: Weight,
    shared_gate_up: Weight,
    shared_down: Weight,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor | None:
    """The MoE block after its router GEMM as one fused few-token op: ``kernels.sparse_moe_decode``
    when the four weights are dense, ``kernels.sparse_moe_decode_nvfp4`` when all four are NVFP4;
    ``None`` for a mix (the caller runs the general ops)."""
    weights = (w13, w2, shared_gate_up, shared_down)
    if all(isinstance(w, torch.Tensor) for w in weights):
        return kernels.sparse_moe_decode(x, gate_logits, *weights, top_k, renormalize)
    if all(isinstance(w, NVFP4Weight) for w in weights):
        packed = [t for w in weights for t in (w.packed, w.scales, w.row_scales)]
        return kernels.sparse_moe_decode_nvfp4(x, gate_logits, *packed, top_k, renormalize)
    return None
