"""The host path to a prompt's first prefill kernel without per-token Python work (issue 10): the
page hashes of one pass over the prompt's bytes are the per-page chain's, page eviction in batches
hands out the pages one at a time would, the stacked slot states reset and copy every layer's rows,
and one upload stages every admission's sampling parameters."""

from __future__ import annotations

import hashlib
import random
from array import array

import numpy as np
import torch

from freetoken.plan import SlotSampling
from freetoken.engine.sample import SlotSampler
from freetoken.layers.slot_state import SlotStates
from freetoken.scheduler.cache import PagePool
from freetoken import LLM, SamplingParams
from freetoken.kernels.prefill_snapshots import PrefillSnapshots
from freetoken.scheduler.prefix_cache import PageHashChain, PrefixCache, page_hashes


def _chain_per_page(token_ids: list[int], page_size: int, namespace: bytes = b"") -> list[bytes]:
    """The hashes as they were computed before: a blake2b per page over an array of its ids."""
    previous = hashlib.blake2b(namespace, digest_size=16, person=b"freetoken-pc").digest()
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("q", token_ids[start : start + page_size]).tobytes())
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def test_page_hashes_are_the_per_page_chain_from_lists_and_arrays():
    rng = random.Random(0)
    for length, page_size in [(1, 16), (15, 16), (16, 16), (8195, 16), (37, 4)]:
        tokens = [rng.randrange(248320) for _ in range(length)]
        want = _chain_per_page(tokens, page_size, b"ns")
        assert page_hashes(tokens, page_size, b"ns") == want
        assert page_hashes(np.array(tokens, dtype=np.int64), page_size, b"ns") == want
        assert len(want) == length // page_size


def test_the_hash_chain_hashes_each_page_once_when_first_asked_for():
    rng = random.Random(1)
    tokens = [rng.randrange(248320) for _ in range(16 * 9 + 5)]
    want = page_hashes(tokens, 16, b"ns")
    chain = PageHashChain(tokens, 16, b"ns")
    assert len(chain) == 9 and chain.num_computed == 0 and chain.computed(0) is None
    assert chain[2] == want[2] and chain.num_computed == 3  # the pages before it, and it
    assert chain.computed(1) == want[1] and chain.computed(3) is None
    assert chain[1:4] == want[1:4] and chain.num_computed == 4
    assert chain[-2:] == want[-2:] and chain[-1] == want[-1] and chain.num_computed == 9
    assert chain[::3] == want[::3] and list(chain) == want and chain[5:2] == []
    for index in (9, -10):
        try:
            chain[index]
        except IndexError:
            continue
        raise AssertionError(f"index {index} of 9 pages did not raise")


def test_a_fresh_prompt_is_hashed_and_its_snapshot_tables_built_behind_the_forward_launch(demo_checkpoint):
    """Before the forward of a prompt nothing shares, its lookup hashes one page (its first miss),
    and the in-forward snapshot's tables are still a function when the forward starts (the first
    Gated DeltaNet layer builds them); the rest of the pages are hashed once the step is queued,
    so a repeat hits them, with the same tokens."""
    llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=4, max_prefill_length=128)
    runtime, engine = llm.runtime, llm.runtime.engine
    hashed_at_launch: list[int] = []
    deferred: list[tuple[bool, bool]] = []
    launch, forward = engine.launch, engine.model.forward

    def spy_launch(plan):
        hashed_at_launch.extend(r.page_hashes.num_computed for r in runtime.scheduler.running if r.num_computed == 0)
        return launch(plan)

    def spy_forward(batch):
        before = callable(batch.snapshots)
        logits = forward(batch)
        deferred.append((before, isinstance(batch.snapshots, PrefillSnapshots)))
        return logits

    engine.launch, engine.model.forward = spy_launch, spy_forward
    prompt = [random.Random(2).randrange(300) for _ in range(70)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (first,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert hashed_at_launch == [1]
    assert deferred[0] == (True, True)  # the snapshot at the last full page (68), inside the chunk
    (repeat,) = llm.generate([{"prompt_token_ids": prompt}], params)
    assert repeat.num_cached_tokens == 68
    assert repeat.token_ids == first.token_ids and len(first.token_ids) == 3


class _Layer:
    def __init__(self, width: int) -> None:
        self.width = width

    def state_shapes(self, num_slots: int, dtype: torch.dtype):
        return {"conv_state": ((num_slots, self.width, 3), dtype), "recurrent_state": ((num_slots, 2, 2), torch.float32)}


def test_stacked_slot_states_reset_and_copy_every_layer_in_one_op_per_stack():
    layers = [_Layer(4), _Layer(4), _Layer(6)]  # two conv shapes: three stacks
    states = SlotStates(layers, 5, torch.float16, torch.device("cpu"))
    assert len(states.stacks) == 3
    for index, layer in enumerate(layers):
        assert layer.conv_state.shape == (5, layer.width, 3) and layer.conv_state.is_contiguous()
        for tensor in (layer.conv_state, layer.recurrent_state):
            tensor.copy_(torch.arange(5).view(-1, *[1] * (tensor.dim() - 1)).expand_as(tensor) + 10 * index)
    states.copy(torch.tensor([1, 2]), torch.tensor([2, 4]))  # 2 is read before it is written
    states.reset(torch.tensor([3]))
    for index, layer in enumerate(layers):
        for tensor in (layer.conv_state, layer.recurrent_state):
            assert tensor.flatten(1)[:, 0].tolist() == [10 * index, 1 + 10 * index, 1 + 10 * index, 0, 2 + 10 * index]


def test_eviction_in_a_batch_frees_the_least_recently_used_pages_in_order():
    pool = PagePool(10, 4)
    cache = PrefixCache(pool, [], 4)
    pages = cache.allocate(9)
    cache.insert_pages([bytes([i]) * 16 for i in range(9)], pages)
    cache.release(pages)  # tail first: pages[8] is the least recently used
    assert cache.num_evictable == 9 and pool.num_free == 0
    got = cache.allocate(3)  # evicted 8, 7, 6 onto the free list; handed out as pops would
    assert got == [pages[6], pages[7], pages[8]]
    assert cache.counters.evicted_pages == 3 and cache.num_cached_pages == 6


def test_one_upload_admits_every_parameter_into_its_slot():
    sampler = SlotSampler(4, 50, torch.device("cpu"))
    admissions = [
        SlotSampling(slot=slot, temperature=0.5 + slot, top_p=0.9, top_k=slot + 3, min_p=0.1 * slot,
                     repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4, seed=2**40 + slot,
                     min_tokens=slot, stop_token_ids=(7, 60), prompt_token_ids=np.array([1, 2, 55, 2]),
                     output_token_ids=(5, 5, 9), logprobs=None)
        for slot in (3, 1)
    ]
    sampler.admit(admissions)
    for a in admissions:
        s = a.slot
        assert sampler.temperature[s].item() == a.temperature and sampler.top_k[s].item() == a.top_k
        assert torch.isclose(sampler.min_p[s], torch.tensor(a.min_p)) and sampler.top_p[s].item() == np.float32(0.9)
        assert (sampler.repetition[s].item(), sampler.presence[s].item()) == (np.float32(1.2), np.float32(0.3))
        assert sampler.frequency[s].item() == np.float32(0.4)
        assert (sampler.seed[s].item(), sampler.min_tokens[s].item(), sampler.num_outputs[s].item()) == (a.seed, s, 3)
        assert sampler.prompt_seen[s].nonzero().flatten().tolist() == [1, 2]  # 55 lies past the vocabulary
        assert sampler.output_counts[s, [5, 9]].tolist() == [2, 1] and sampler.output_counts[s].sum() == 3
        assert sampler.stop_mask[s].nonzero().flatten().tolist() == [7]
    assert sampler.temperature[2].item() == 1.0 and sampler.output_counts[2].sum() == 0  # untouched slot
