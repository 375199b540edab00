"""Engine options. Each field is a keyword argument of ``LLM`` and a CLI flag (``max_prefill_length``
is ``--max-prefill-length``); the help text lives beside the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from freetoken.fields import option

DType = Literal["auto", "bfloat16", "float16", "float32"]
Device = Literal["auto", "cuda", "cpu"]
KernelBackendName = Literal["auto", "torch", "triton"]
LoadFormat = Literal["auto", "dummy"]


@dataclass
class EngineConfig:
    model: str | None = option(None, "Hugging Face model directory (default: the embedded demo model)")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model directory)")
    dtype: DType = option("auto", "weights and activations dtype; auto takes the checkpoint's (bf16 if unset)")
    load_format: LoadFormat = option(
        "auto", "auto: the model directory's safetensors; dummy: random weights made on the device (config.json only)"
    )
    device: Device = option("auto", "cuda if a GPU is visible, else cpu")
    kernel_backend: KernelBackendName = option(
        "auto", "ops implementation: triton on CUDA and torch on CPU by default; triton on CPU runs the interpreter"
    )
    max_prefill_length: int = option(
        8192, "prompt tokens computed per forward (chunked prefill); not a limit on prompt length"
    )
    max_running_requests: int = option(64, "requests decoded together (also the Gated DeltaNet state slots)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's)")
    page_size: int = option(16, "tokens per KV-cache page")
    num_pages: int | None = option(None, "usable KV-cache pages (default: sized from free memory)")
    gpu_memory_fraction: float = option(
        0.85, "fraction of the GPU memory free after loading weights given to KV pages and states"
    )
    cpu_kv_cache_gib: float = option(2.0, "on the CPU, memory for KV pages and states in GiB")
    gpu_memory_gib: float | None = option(
        None, "cap in GiB on the GPU memory FreeToken's tensors take (weights, pools, expert cache, headroom), "
        "to reproduce a smaller card on a bigger one (default: no cap)"
    )
    moe_offload: bool = option(
        False, "keep the routed experts in host memory and run them from a device cache of expert slots "
        "(CUDA graphs off)"
    )
    expert_cache_slots: int | None = option(
        None, "with moe_offload: experts the device cache holds, shared by all layers (default: on CUDA what is "
        "free after the weights and the KV pool; on the CPU one layer's experts)"
    )
    expert_cache_policy: str = option(
        "lrfu", "with moe_offload: which cached expert gives up its slot (experts/eviction.py: lru, lrfu, arc)"
    )
    expert_prefill_stream: bool = option(
        True, "with moe_offload: prompt chunks (eager forwards of at least 256 tokens) copy in the experts the "
        "next layer's router picks for this layer's input while this layer computes, the first layer's from the "
        "token embeddings at the chunk's start"
    )
    prefill_stream_depth: int = option(
        1, "with moe_offload and expert_prefill_stream: how many layers ahead a prompt chunk's experts are "
        "streamed in; at each layer's routing the routers of the next N layers pick from its input (N > 1 keeps "
        "that many layers' copies queued; the cache needs room for them)"
    )
    expert_prefetch: bool = option(
        False, "with moe_offload: every eager forward (decode batches over 8 too) streams the next layer's "
        "experts in as prompt chunks do"
    )
    seed: int = option(0, "seed from which unseeded requests draw their sampling seeds")
    overlap_schedule: bool = option(
        True, "schedule and stage the next step, and resolve the previous one, while the device runs a step"
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV pages and Gated DeltaNet / PLE state snapshots of prompts' shared prefixes (vLLM's flag)"
    )
    max_snapshot_slots: int | None = option(
        None,
        "state snapshots the prefix cache keeps, each one slot of recurrent state (~63 MB at Qwen3.6-35B-A3B; "
        "default: max_running_requests, 0 with prefix caching off)",
    )
    enforce_eager: bool = option(False, "run every step eagerly: no CUDA graphs (decode or prefill)")
    cuda_graph_max_bs: int | None = option(
        None, "largest decode batch replayed from a CUDA graph (default: max_running_requests); larger ones run eagerly"
    )
    prefill_cuda_graph_max_tokens: int = option(
        1024, "largest prefill-only step, in tokens, replayed from a CUDA graph (buckets 64, 128, 256, 512, then "
        "multiples of 128 up to it, at most max_prefill_length); 0: prefill always eager"
    )
    prefill_cuda_graph_max_seqs: int = option(
        1, "most requests in a prefill-only step replayed from a CUDA graph (one graph per count and bucket)"
    )

    @property
    def num_snapshot_slots(self) -> int:
        """State slots set aside for prefix-cache snapshots."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_running_requests if self.max_snapshot_slots is None else self.max_snapshot_slots

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def validate(self) -> None:
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_snapshot_slots is not None and self.max_snapshot_slots < 0:
            raise ValueError(f"max_snapshot_slots must be >= 0, got {self.max_snapshot_slots}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.prefill_cuda_graph_max_tokens < 0:
            raise ValueError(f"prefill_cuda_graph_max_tokens must be >= 0, got {self.prefill_cuda_graph_max_tokens}")
        if self.prefill_cuda_graph_max_seqs < 1:
            raise ValueError(f"prefill_cuda_graph_max_seqs must be >= 1, got {self.prefill_cuda_graph_max_seqs}")
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise ValueError(f"expert_cache_slots must be >= 1, got {self.expert_cache_slots}")
        if self.prefill_stream_depth < 1:
            raise ValueError(f"prefill_stream_depth must be >= 1, got {self.prefill_stream_depth}")
        from freetoken.experts.eviction import POLICIES

        if self.expert_cache_policy not in POLICIES:
            raise ValueError(f"expert_cache_policy must be one of {', '.join(sorted(POLICIES))}, "
                             f"got {self.expert_cache_policy!r}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
