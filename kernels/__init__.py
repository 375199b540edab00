"""FreeToken's ops: one function per op, a plain-torch reference and a Triton kernel behind it.

Every public op here dispatches through :mod:`freetoken.kernels.dispatch`: the torch reference
(``<op>_reference`` in the op's module, written for clarity, the oracle of the tests) or the
Triton kernel (``freetoken.kernels.triton.<module>.<op>``, same signature). Nothing above the
layers knows which one ran.
"""

from freetoken.kernels.dispatch import KernelBackend, get_kernel_backend, set_kernel_backend
from freetoken.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm
from freetoken.kernels.rotary import apply_rotary, build_rotary_cache
from freetoken.kernels.attention import paged_attention, store_kv
from freetoken.kernels.attention_prologue import norm_rotary_store_kv
from freetoken.kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill
from freetoken.kernels.gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_prefill
from freetoken.kernels.moe import (
    fused_experts,
    fused_experts_pairs,
    fused_experts_shared_pairs,
    moe_combine_add_rms_norm,
    moe_sort_tokens,
    moe_topk_softmax,
    shared_expert_combine,
    silu_and_mul,
)
from freetoken.kernels.gemv import gemv
from freetoken.kernels.normed_nvfp4_gemv import add_rms_norm_nvfp4_gemv
from freetoken.kernels.normed_gemv import add_rms_norm_gemv, add_rms_norm_gemv_conv
from freetoken.kernels.nvfp4 import fused_experts_nvfp4, nvfp4_linear, sparse_moe_decode_nvfp4
from freetoken.kernels.moe_decode import sparse_moe_decode
from freetoken.kernels.moe_decode_offload import sparse_moe_decode_offload, sparse_moe_decode_offload_nvfp4
from freetoken.kernels.gdn_decode import gated_delta_rule_decode_gated, gated_delta_rule_decode_gated_norm
from freetoken.kernels.sampling import greedy_sample_into_slots, sample_tokens
from freetoken.kernels.hyper_connection import hc_combine, hc_mix, hc_norm
from freetoken.kernels.ngram import ngram_embed, ngram_update_context
from freetoken.kernels.ple import ple_gate, ple_short_conv
from freetoken.kernels.qsa import qsa_select_blocks, qsa_sparse_attention, qsa_update_index

__all__ = [
    "KernelBackend",
    "get_kernel_backend",
    "set_kernel_backend",
    "rms_norm",
    "add_rms_norm",
    "gated_rms_norm",
    "apply_rotary",
    "build_rotary_cache",
    "store_kv",
    "paged_attention",
    "norm_rotary_store_kv",
    "causal_conv1d_prefill",
    "causal_conv1d_decode",
    "gated_delta_rule_prefill",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_gated",
    "gated_delta_rule_decode_gated_norm",
    "moe_topk_softmax",
    "moe_sort_tokens",
    "fused_experts",
    "fused_experts_pairs",
    "fused_experts_shared_pairs",
    "moe_combine_add_rms_norm",
    "silu_and_mul",
    "shared_expert_combine",
    "gemv",
    "add_rms_norm_gemv",
    "add_rms_norm_nvfp4_gemv",
    "add_rms_norm_gemv_conv",
    "nvfp4_linear",
    "fused_experts_nvfp4",
    "sparse_moe_decode_nvfp4",
    "sparse_moe_decode",
    "sparse_moe_decode_offload",
    "sparse_moe_decode_offload_nvfp4",
    "sample_tokens",
    "greedy_sample_into_slots",
    "hc_norm",
    "hc_mix",
    "hc_combine",
    "ngram_embed",
    "ngram_update_context",
    "ple_gate",
    "ple_short_conv",
    "qsa_update_index",
    "qsa_select_blocks",
    "qsa_sparse_attention",
]
