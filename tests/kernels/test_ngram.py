from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE
from freetoken.kernels import ngram as ref
from freetoken.layers.ple import head_vocab_sizes, layer_multipliers

VOCAB, EOS = 400, 399


def _case(rng, ngram_size: int, heads_per_ngram: int, query_lens: list[int], head_dim: int = 5):
    """A batch of requests (decodes and chunks) with EOS tokens in the new tokens and in the contexts."""
    num_heads = (ngram_size - 1) * heads_per_ngram
    sizes = head_vocab_sizes(31, num_heads, num_heads)  # the second PLE layer's primes
    offsets = torch.tensor([0] + sizes[:-1]).cumsum(0)
    table = torch.randn(sum(sizes) + 3, head_dim, generator=rng)
    num_tokens, num_slots = sum(query_lens), 7
    ids = torch.randint(0, VOCAB, (num_tokens,), generator=rng)
    ids[torch.rand(num_tokens, generator=rng) < 0.2] = EOS
    context = torch.randint(0, VOCAB, (num_slots, ngram_size - 1), generator=rng)
    context[torch.rand(context.shape, generator=rng) < 0.2] = EOS
    slots = (torch.randperm(num_slots - 1, generator=rng)[: len(query_lens)] + 1).int()
    cu = torch.tensor([0] + query_lens).cumsum(0).int()
    requests = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    constants = (
        torch.tensor(layer_multipliers(VOCAB, ngram_size, 1, 1234)),
        torch.tensor(sizes),
        offsets,
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(ids), to(context), to(slots), to(requests), to(cu), [to(c) for c in constants], table


@pytest.mark.parametrize("ngram_size,heads_per_ngram", [(2, 3), (3, 2), (5, 1)])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 3, 1, 9], [17]], ids=["decode", "mixed", "prefill"])
def test_ngram_embed_and_context(rng, ngram_size, heads_per_ngram, query_lens):
    from freetoken.kernels.triton.ngram import ngram_embed, ngram_update_context

    ids, context, slots, requests, cu, (mult, sizes, offsets), table = _case(rng, ngram_size, heads_per_ngram, query_lens)
    args = (ids, context, slots, requests, cu, mult, sizes, offsets, heads_per_ngram, EOS, table.to(DEVICE))
    assert torch.equal(ngram_embed(*args), ref.ngram_embed_reference(*args))
    want_context = context.clone()
    ref.ngram_update_context_reference(ids, want_context, slots, cu)
    ngram_update_context(ids, context, slots, cu)
    assert torch.equal(context, want_context)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ngram_embed_reads_a_pinned_host_table_from_the_gpu(rng):
    """The table stays in host memory, registered with CUDA in place; the kernel gathers its rows
    over PCIe into a GPU tensor, and the torch reference (host gather, then copy) agrees."""
    from freetoken.kernels.triton.ngram import ngram_embed
    from freetoken.layers.ple import _pin_in_place

    ids, context, slots, requests, cu, (mult, sizes, offsets), table = _case(rng, 3, 2, [1, 5, 1, 12])
    _pin_in_place(table)  # unregistered when the table is freed (a second unregister would leave a CUDA error)
    args = (ids, context, slots, requests, cu, mult, sizes, offsets, 2, EOS, table)
    got = ngram_embed(*args)
    assert got.device.type == "cuda" and table.device.type == "cpu"
    assert torch.equal(got, ref.ngram_embed_reference(*args))
