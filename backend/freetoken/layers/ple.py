"""Qwen4-Exp PLE (per-layer embedding) layers: hashed n-gram embeddings injected into every
hyper-connection stream, gated by the stream, plus a dilated short convolution.

The n-gram table of a PLE layer is large (about 45B parameters over the layers of the released
model, ~90 GiB in bf16), so it never lives on the GPU: it is a host tensor, registered (pinned in
place) with CUDA when the model runs there, and each step reads only the rows its tokens hash to
(``kernels.ngram_embed``). See docs/qwen4_exp.md.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.batch import ForwardBatch
from freetoken.layers.linear import linear
from freetoken.layers.slot_state import StateShapes
from freetoken.layers.weights import WeightTarget, chunked_targets, new_param, packed_targets

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    """The odd hash multipliers of one PLE layer, bounded so that ``token · m`` never overflows int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STRIDE * ple_layer_index
    return [2 * (_splitmix64((base + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_vocab_sizes(base: int, first_head: int, num_heads: int) -> list[int]:
    """Distinct primes: head ``g`` (global over all PLE layers) hashes modulo the ``g+1``-th prime >= ``base``."""
    sizes, prime = [], base - 1
    for _ in range(first_head + num_heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        sizes.append(prime)
    return sizes[first_head:]


@dataclass(frozen=True)
class NGramSizes:
    """A model's hashed n-gram tables: alike in every PLE layer but for the hash constants."""

    vocab_size: int  # of the model's tokens (bounds the hash multipliers)
    ngram_size: int
    heads_per_ngram: int
    embed_dim: int  # all heads of one token together
    vocab_size_base: int  # head g hashes modulo the (g+1)-th prime >= this
    rows_divisible_by: int  # a table's rows are rounded up to a multiple of this
    split_parts: int  # row chunks a checkpoint stores a table in
    seed: int


@dataclass(frozen=True)
class PLESizes:
    hidden_size: int
    num_streams: int  # hyper-connection streams
    eps: float
    conv_kernel_size: int
    ngram: NGramSizes


class NGramEmbedding(nn.Module):
    """One PLE layer's hashed n-gram table ``[rows, head_dim]`` (host memory) and its hash constants."""

    def __init__(self, sizes: NGramSizes, ple_layer_index: int) -> None:
        super().__init__()
        self.heads_per_ngram = sizes.heads_per_ngram
        num_heads = (sizes.ngram_size - 1) * sizes.heads_per_ngram
        self.head_dim = sizes.embed_dim // num_heads
        head_sizes = head_vocab_sizes(sizes.vocab_size_base, ple_layer_index * num_heads, num_heads)
        offsets = [sum(head_sizes[:i]) for i in range(num_heads)]
        divisor = sizes.rows_divisible_by
        rows = -(-sum(head_sizes) // divisor) * divisor
        self.split_parts = sizes.split_parts
        self.register_buffer(
            "multipliers",
            torch.tensor(layer_multipliers(sizes.vocab_size, sizes.ngram_size, ple_layer_index, sizes.seed)),
        )
        self.register_buffer("head_vocab_sizes", torch.tensor(head_sizes, dtype=torch.int64))
        self.register_buffer("head_offsets", torch.tensor(offsets, dtype=torch.int64))
        self.table = nn.Parameter(torch.empty(rows, self.head_dim, device="cpu"), requires_grad=False)
        if torch.get_default_device().type == "cuda":
            _pin_in_place(self.table)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        table = f"{prefix}ngram_embedding."
        targets = {f"{table}weight": WeightTarget(self.table)}
        targets.update(chunked_targets(self.table, f"{table}shard_{{}}.weight", self.split_parts))
        targets[f"{prefix}layer_multipliers"] = WeightTarget(self.multipliers)
        targets[f"{prefix}ngram_heads_vocab_sizes"] = WeightTarget(self.head_vocab_sizes)
        targets[f"{prefix}ngram_heads_offsets"] = WeightTarget(self.head_offsets)
        return targets

    def forward(
        self, batch: ForwardBatch, token_request: torch.Tensor, context: torch.Tensor, eos_token_id: int
    ) -> torch.Tensor:
        """``[T, heads · head_dim]`` embeddings of the step's tokens, on the activations' device."""
        return kernels.ngram_embed(
            batch.input_ids,
            context,
            batch.state_slots,
            token_request,
            batch.cu_seqlens,
            self.multipliers,
            self.head_vocab_sizes,
            self.head_offsets,
            self.heads_per_ngram,
            eos_token_id,
            self.table,
        )


def _pin_in_place(tensor: torch.Tensor) -> None:
    """Page-lock host memory where it is (``pin_memory()`` would copy it, and round a 90 GiB table up to
    128 GiB) and map it for the GPU, so kernels can read rows of it directly (zero-copy)."""
    portable_and_mapped = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, portable_and_mapped))
    if error:
        raise RuntimeError(f"cudaHostRegister of the {tensor.nbytes / 2**30:.1f} GiB n-gram table failed: error {error}")
    # Unregister when the table is freed: the allocator may hand the same address range to the next
    # model's table, and registering a range twice fails (cudaErrorHostMemoryAlreadyRegistered).
    weakref.finalize(tensor, _unpin, tensor.data_ptr())


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class PLELayer(nn.Module):
    """``hyper + gated + silu(conv(norm(gated)))``, ``gated_s = sigmoid(g_s) · value`` for each stream
    ``s``, where ``g_s`` compares the stream with the n-gram key of the token.

    State per request slot: the convolution's last ``(K - 1) · ngram_size`` inputs ``[S, n * H]``.
    The n-gram context (the last tokens) is shared by all PLE layers and owned by the model.
    """

    def __init__(self, sizes: PLESizes, ple_layer_index: int) -> None:
        super().__init__()
        self.num_streams = sizes.num_streams
        self.hidden_size = sizes.hidden_size
        self.eps = sizes.eps
        width = sizes.num_streams * sizes.hidden_size
        self.width = width
        self.dilation = sizes.ngram.ngram_size
        self.state_len = (sizes.conv_kernel_size - 1) * sizes.ngram.ngram_size
        self.embedding = NGramEmbedding(sizes.ngram, ple_layer_index)
        self.key_value = new_param(width + sizes.hidden_size, sizes.ngram.embed_dim)
        self.norm_key = new_param(width)
        self.norm_query = new_param(width)
        self.norm_conv = new_param(width)
        self.conv_weight = new_param(width, sizes.conv_kernel_size)
        self.conv_state: torch.Tensor | None = None

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = packed_targets(
            self.key_value, prefix, [("key_proj.weight", self.width), ("value_proj.weight", self.hidden_size)]
        )
        targets.update(self.embedding.weight_targets(f"{prefix}ple_embedding."))
        targets.update(
            {
                f"{prefix}norm_key.weight": WeightTarget(self.norm_key),
                f"{prefix}norm_query.weight": WeightTarget(self.norm_query),
                f"{prefix}norm_conv.weight": WeightTarget(self.norm_conv),
                f"{prefix}conv1d.weight": WeightTarget(self.conv_weight),
            }
        )
        return targets

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        return self.state_len * self.width * dtype.itemsize

    def state_shapes(self, num_slots: int, dtype: torch.dtype) -> StateShapes:
        """The dilated conv's input window (``layers.slot_state.SlotStates`` stacks it across layers)."""
        return {"conv_state": ((num_slots, self.state_len, self.width), dtype)}

    def forward(
        self,
        hyper: torch.Tensor,
        batch: ForwardBatch,
        token_request: torch.Tensor,
        context: torch.Tensor,
        eos_token_id: int,
    ) -> torch.Tensor:
        embedding = self.embedding(batch, token_request, context, eos_token_id)
        key, value = linear(embedding.to(hyper.dtype), self.key_value).split([self.width, self.hidden_size], dim=-1)
        key = kernels.hc_norm(key, self.norm_key, self.eps, self.num_streams)
        query = kernels.hc_norm(hyper, self.norm_query, self.eps, self.num_streams)
        gated = kernels.ple_gate(key, query, value, self.num_streams)
        normed = kernels.hc_norm(gated, self.norm_conv, self.eps, self.num_streams)
        conv = kernels.ple_short_conv(
            normed, self.conv_weight, self.conv_state, batch.state_slots, token_request, batch.cu_seqlens, self.dilation
        )
        return hyper + (gated + conv)
