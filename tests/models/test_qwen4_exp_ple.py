"""PLE n-gram embeddings: hashing and EOS handling equal transformers' module across chunked steps;
tables stored in ``split_ngram_parts`` shards load whole; the table stays in host memory."""

from __future__ import annotations

import pytest
import torch

from freetoken import kernels
from freetoken.layers.ple import NGramEmbedding
from freetoken.layers.weights import chunked_targets
from freetoken.models.loader import load_model
from freetoken.models.qwen4_exp import Qwen4ExpModel
from freetoken.models.qwen4_exp.text_config import ngram_sizes
from freetoken.demo import QWEN4_EXP_TEXT_CONFIG
from oracle import EOS, Case, checkpoint, reference_model


def _text_config(**overrides):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**{**QWEN4_EXP_TEXT_CONFIG, "vocab_size": 400, "eos_token_id": EOS, **overrides})


@pytest.mark.parametrize("ngram_size", [2, 3, 5])
def test_ngram_embeddings_equal_reference_module_across_steps(ngram_size):
    """Two requests advance together through chunks of different sizes (1 = decode); EOS tokens sit at
    chunk starts, chunk ends and back to back, so n-grams are cut across the carried context too."""
    from transformers import DynamicCache
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    config = _text_config(ngram_size=ngram_size, heads_per_ngram=2, ple_embed_dim=(ngram_size - 1) * 2 * 3)
    ple_layer_index = 1
    torch.manual_seed(0)
    reference = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=ple_layer_index)
    mine = NGramEmbedding(ngram_sizes(config), ple_layer_index)
    assert mine.table.shape == reference.ngram_embedding.weight.shape
    assert mine.multipliers.tolist() == reference.layer_multipliers.tolist()
    assert mine.head_vocab_sizes.tolist() == reference.ngram_heads_vocab_sizes.tolist()
    assert mine.head_offsets.tolist() == reference.ngram_heads_offsets.tolist()
    mine.table.data.copy_(torch.randn(mine.table.shape))
    reference.ngram_embedding.weight.data.copy_(mine.table)

    tokens = [
        [11, EOS, 12, 13, 14, 15, EOS, EOS, 16, 17, 18, 19, 20, EOS, 21, 22, 23],
        [EOS, 31, 32, 33, EOS, 34, 35, 36, 37, 38, 39, EOS, EOS, EOS, 40, 41, 42],
    ]
    chunks = [[3, 5], [1, 1], [2, 4], [1, 1], [6, 1], [1, 3], [3, 2]]  # per step, tokens of each request
    caches = [DynamicCache(config=config) for _ in tokens]
    context = torch.full((3, ngram_size - 1), EOS, dtype=torch.int64)
    slots = torch.tensor([2, 1], dtype=torch.int32)
    done = [0, 0]
    for lengths in chunks:
        pieces = [tokens[b][done[b] : done[b] + n] for b, n in enumerate(lengths)]
        input_ids = torch.tensor(pieces[0] + pieces[1])
        cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        token_request = torch.tensor([0] * lengths[0] + [1] * lengths[1])
        got = kernels.ngram_embed(
            input_ids, context, slots, token_request, cu_seqlens, mine.multipliers, mine.head_vocab_sizes,
            mine.head_offsets, mine.heads_per_ngram, EOS, mine.table,
        )
        kernels.ngram_update_context(input_ids, context, slots, cu_seqlens)
        with torch.no_grad():
            want = torch.cat([reference(torch.tensor([p]), caches[b])[0] for b, p in enumerate(pieces)])
        assert torch.equal(got, want), f"step with chunks {lengths}"
        done = [d + n for d, n in zip(done, lengths)]


@pytest.mark.parametrize("shape", ["blocks_of_a_page", "blocks_within_pages"])
def test_split_ngram_tables_load_whole(shape):
    """12 shards (names sort out of numeric order) and 5 uneven shards in sharded safetensors files."""
    path = checkpoint(Case("qwen4_exp", shape))
    loaded = load_model(str(path), "float32", torch.device("cpu")).model
    reference = reference_model(path)
    language_model = getattr(reference.model, "language_model", reference.model)
    ple_layers = [(i, layer.ple) for i, layer in enumerate(loaded.layers) if layer.ple is not None]
    assert ple_layers
    for i, ple in ple_layers:
        want = language_model.layers[i].ple.ple_embedding
        assert torch.equal(ple.embedding.table, want.ngram_embedding.weight)
        assert torch.equal(ple.embedding.multipliers, want.layer_multipliers)


def test_chunked_targets_follow_torch_chunk():
    for rows, parts in [(256, 5), (384, 5), (10, 4), (6, 4), (3, 8), (512, 512)]:
        param = torch.nn.Parameter(torch.arange(rows * 2, dtype=torch.float32).view(rows, 2), requires_grad=False)
        targets = chunked_targets(param, "shard_{}.weight", parts)
        chunks = torch.chunk(param.data, parts)
        assert list(targets) == [f"shard_{i}.weight" for i in range(len(chunks))]
        for target, chunk in zip(targets.values(), chunks):
            assert torch.equal(target.destination(), chunk)


def test_ngram_table_stays_in_host_memory():
    """Whatever device the model is built on, the n-gram tables are host tensors (the GPU reads only
    the rows a step needs from them); everything else follows the build device."""
    config = _text_config()
    with torch.device("meta"):
        model = Qwen4ExpModel(config, tie_word_embeddings=False)
    tables = {name for name, p in model.named_parameters() if name.endswith("embedding.table")}
    assert len(tables) == len(config.ple_layer_ids)
    for name, param in model.named_parameters():
        assert param.device.type == ("cpu" if name in tables else "meta"), name
