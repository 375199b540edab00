"""How many KV pages and state slots fit in the memory left after the weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from freetoken.config import EngineConfig
from freetoken.engine.sample import SlotSampler
from freetoken.models.base import CausalLM

logger = logging.getLogger(__name__)

GiB = 1 << 30
# Kept free on the GPU beyond the pools: the driver and the allocator grow after the first kernel
# launches (the per-thread stack limit alone took 1.3-3.3 GiB on sm_120 with Triton < 3.8), and
# activations of the largest prefill chunk need room too.
GPU_HEADROOM_BYTES = 2 * GiB
# Activation bytes per prefill token per hidden unit, a generous bound on what one layer keeps live.
ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN = 48


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int  # including the reserved page 0
    num_slots: int  # request slots, including the reserved slot 0
    bytes_per_page: int
    bytes_per_slot: int
    num_snapshot_slots: int = 0  # prefix-cache snapshots: state slots num_slots .. num_slots + this - 1

    @property
    def num_state_slots(self) -> int:
        """Rows of every per-slot state tensor: the request slots, then the snapshot slots."""
        return self.num_slots + self.num_snapshot_slots

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_state_slots * self.bytes_per_slot


def free_gpu_bytes(config: EngineConfig, device: torch.device) -> int:
    """The GPU memory free for FreeToken now: what the driver reports, and under ``gpu_memory_gib``
    (``--gpu-memory-gib``) at most the cap less what FreeToken's tensors already hold, so a smaller
    card is reproduced on a bigger one (the CUDA context, ~0.5 GiB, is outside the cap)."""
    # Blocks the caching allocator kept from loading (temporaries) are free for the pools too.
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if config.gpu_memory_gib is None:
        return free
    held = torch.cuda.memory_reserved(device)
    cap = int(config.gpu_memory_gib * GiB)
    if held > cap:
        raise MemoryError(
            f"the weights take {held / GiB:.2f} GiB on {device}, more than gpu_memory_gib {config.gpu_memory_gib}"
            + ("" if config.moe_offload else "; moe_offload keeps the routed experts in host memory")
        )
    return min(free, cap - held)


def pool_budget_bytes(config: EngineConfig, device: torch.device, hidden_size: int) -> int:
    """Bytes for KV pages, state slots and (with ``moe_offload``) the expert cache: on a GPU,
    ``gpu_memory_fraction`` (``--gpu-memory-fraction``, default 0.85) of the memory free once the
    weights are loaded (``free_gpu_bytes``), less ``GPU_HEADROOM_BYTES`` and the activations of one
    ``max_prefill_length`` chunk."""
    if device.type != "cuda":
        return int(config.cpu_kv_cache_gib * GiB)
    free = free_gpu_bytes(config, device)
    activations = config.max_prefill_length * hidden_size * ACTIVATION_BYTES_PER_TOKEN_PER_HIDDEN
    return max(0, int(free * config.gpu_memory_fraction) - GPU_HEADROOM_BYTES - activations)


def size_pools(
    model: CausalLM, config: EngineConfig, device: torch.device, max_model_len: int, hidden_size: int
) -> PoolSizes:
    page_bytes = model.kv_bytes_per_page(config.page_size)
    slot_bytes = model.state_bytes_per_slot()
    num_slots = config.max_running_requests + 1
    num_snapshots = config.num_snapshot_slots
    pages_per_request = -(-max_model_len // config.page_size)
    useful_pages = config.max_running_requests * pages_per_request + 1
    if config.num_pages is not None:
        num_pages = config.num_pages + 1  # usable pages, as stated; page 0 is the reserved null page
    else:
        # The sampler's per-slot tables ([slots, vocab] counts and masks) come out of the same memory.
        sampler_bytes = SlotSampler.device_bytes(num_slots, model.vocab_size)
        budget = pool_budget_bytes(config, device, hidden_size) - (num_slots + num_snapshots) * slot_bytes - sampler_bytes
        affordable = budget // page_bytes if page_bytes else useful_pages
        num_pages = int(min(affordable, useful_pages))
        if num_pages < 2:
            raise MemoryError(
                f"no memory left for the KV cache on {device}: {budget / GiB:.2f} GiB after weights and "
                f"{num_slots} state slots and {num_snapshots} snapshot slots; lower max_running_requests or "
                "max_snapshot_slots, or raise the memory fraction"
            )
    sizes = PoolSizes(num_pages, num_slots, page_bytes, slot_bytes, num_snapshots)
    logger.info(
        "KV cache: %d pages of %d tokens, %d state slots, %d prefix-cache snapshot slots (%.2f GiB), %.2f GiB",
        num_pages - 1,
        config.page_size,
        num_slots - 1,
        num_snapshots,
        num_snapshots * slot_bytes / GiB,
        sizes.total_bytes / GiB,
    )
    return sizes


def size_expert_cache(
    config: EngineConfig, device: torch.device, pools: PoolSizes, hidden_size: int, expert_bytes: int,
    num_experts: int, num_layers: int,
) -> int:
    """Device slots of the expert cache (``moe_offload``): ``expert_cache_slots`` if set, else on a
    GPU what the budget of ``pool_budget_bytes`` leaves after the KV pages and state slots (the KV
    pool is sized first; ``num_pages`` or ``max_model_len`` x ``max_running_requests`` bound it, so
    they move the split), on the CPU one layer's experts. Never more than every layer's experts."""
    everything = num_experts * num_layers
    if config.expert_cache_slots is not None:
        slots = config.expert_cache_slots
    elif device.type != "cuda":
        slots = num_experts
    else:
        left = pool_budget_bytes(config, device, hidden_size) - pools.total_bytes
        slots = max(0, left) // expert_bytes
        if slots < 1:
            raise MemoryError(
                f"no memory left for the expert cache on {device}: {left / GiB:.2f} GiB after the weights and "
                f"{pools.total_bytes / GiB:.2f} GiB of KV pages and states; lower num_pages, max_model_len or "
                f"max_running_requests, or set expert_cache_slots"
            )
    slots = min(slots, everything)
    if slots < num_experts:
        logger.warning("expert cache of %d slots holds fewer than one layer's %d experts: layers routed to more "
                       "run in passes", slots, num_experts)
    logger.info("expert cache: %d of %d experts (%.2f GiB), beside %.2f GiB of KV pages and states", slots, everything,
                slots * expert_bytes / GiB, pools.total_bytes / GiB)
    return slots
