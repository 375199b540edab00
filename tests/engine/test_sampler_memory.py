"""The sampler's per-slot device tables are counted by the pool sizing, so the KV pool does not
take the memory they need (issue 9)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from freetoken.config import EngineConfig
from freetoken.engine.memory import GiB, size_pools
from freetoken.engine.sample import SlotSampler


def test_device_bytes_are_the_tables_a_sampler_allocates():
    sampler = SlotSampler(5, 1000, torch.device("cpu"))
    allocated = sum(t.nbytes for t in vars(sampler).values() if isinstance(t, torch.Tensor))
    assert SlotSampler.device_bytes(5, 1000) == allocated
    # Per slot: int32 counts + bool prompt and stop masks per token; 6 float32, 1 int32, 4 int64 scalars.
    assert allocated == 5 * (1000 * (4 + 1 + 1) + 6 * 4 + 4 + 4 * 8)
    # The real shape: 64 requests (+ the scratch slot) over Qwen3.6's 248,320 tokens: ~97 MB.
    assert SlotSampler.device_bytes(65, 248320) == 65 * (248320 * 6 + 60)


def test_size_pools_leaves_room_for_the_sampler():
    page_bytes, slot_bytes, vocab = 1 << 20, 3 << 20, 248320
    model = SimpleNamespace(vocab_size=vocab, kv_bytes_per_page=lambda page_size: page_bytes,
                            state_bytes_per_slot=lambda: slot_bytes)
    config = EngineConfig(max_running_requests=64, cpu_kv_cache_gib=1.0, page_size=16, max_snapshot_slots=8)
    sizes = size_pools(model, config, torch.device("cpu"), max_model_len=1 << 20, hidden_size=2048)
    assert sizes.num_slots == 65 and sizes.num_snapshot_slots == 8
    sampler = SlotSampler.device_bytes(65, vocab)  # snapshots sample nothing: no tables of their own
    state = (65 + 8) * slot_bytes
    assert sizes.num_pages == (GiB - state - sampler) // page_bytes
    # Without the sampler's 97 MB the pool would have had 93 more pages than the memory holds.
    assert (GiB - state) // page_bytes - sizes.num_pages == 93
