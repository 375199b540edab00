"""The HBM floor: its arithmetic by hand, a model's traffic read off its shapes, and the published
floor of the Qwen3.6-35B-A3B shape (docs/benchmarks.md, issue 9)."""

from __future__ import annotations

import pytest
import torch
import transformers

from freetoken.bench.floor import DecodeTraffic, KVRead, decode_floor, decode_traffic_of, expected_distinct_experts
from freetoken.bench.presets import preset_config
from freetoken.demo import DEMO_TEXT_CONFIG
from freetoken.models.loader import build_model


def test_expected_distinct_experts():
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8.0)
    # 256 * (1 - (31/32)^64): 64 tokens miss a given expert with probability 0.13109
    assert expected_distinct_experts(256, 8, 64) == pytest.approx(222.44, abs=0.01)
    assert expected_distinct_experts(4, 2, 2) == pytest.approx(3.0)  # 4 * (1 - 1/4)


def test_floor_adds_its_parts_by_hand():
    traffic = DecodeTraffic(
        dense_weight_bytes=1000,
        embedding_row_bytes=10,
        expert_bytes=100,
        num_experts=4,
        top_k=2,
        num_moe_layers=3,
        kv_layers=(KVRead(8), KVRead(8, max_tokens=5, index_bytes_per_token=0.5)),
        state_bytes_per_sequence=50,
    )
    floor = decode_floor(traffic, batch_size=2, context_len=10, bandwidth=100.0)
    assert floor.non_expert_weight_bytes == 1000 + 2 * 10
    assert floor.experts_per_layer == pytest.approx(3.0)
    assert floor.expert_weight_bytes == pytest.approx(3 * 100 * 3)
    assert floor.kv_bytes == pytest.approx(2 * (10 * 8 + (5 * 8 + 0.5 * 10)))  # full layer + QSA layer
    assert floor.state_bytes == 2 * 50
    assert floor.total_bytes == pytest.approx(1020 + 900 + 250 + 100)
    assert floor.as_dict()["ms"] == pytest.approx(2270 / 100 * 1e3)


def test_traffic_of_the_demo_shape_by_hand():
    config = transformers.Qwen3_5MoeTextConfig(**DEMO_TEXT_CONFIG, vocab_size=400)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    traffic = decode_traffic_of(build_model(config, torch.bfloat16, torch.device("meta")))
    # hidden 64; GDN: 2 key / 4 value heads of 16 (q|k|v conv channels 128), conv 4; attention 4 q /
    # 2 kv heads of 32, q with its gate; 8 experts top-2 of 32, shared expert 48; 3 GDN + 1 attention.
    gdn = (128 + 64 + 2 * 4) * 64 + 128 * 4 + 4 + 4 + 16 + 64 * 64
    attention = (2 * 4 * 32 + 2 * 2 * 32) * 64 + 64 * 4 * 32 + 32 + 32
    moe_dense = 16 * 64 + 2 * 48 * 64 + 64 * 48  # router + shared gate: 8 + 1 rows padded to 16 (read too)
    layer_norms = 2 * 64
    dense = 3 * gdn + attention + 4 * (moe_dense + layer_norms) + 64 + 400 * 64  # + final norm, lm_head
    assert traffic.dense_weight_bytes == 2 * dense
    assert traffic.embedding_row_bytes == 2 * 64
    assert traffic.expert_bytes == 2 * (2 * 32 * 64 + 64 * 32)
    assert (traffic.num_experts, traffic.top_k, traffic.num_moe_layers) == (8, 2, 4)
    assert traffic.kv_layers == (KVRead(2 * 2 * 32 * 2),)
    assert traffic.state_bytes_per_sequence == 2 * 3 * (128 * 3 * 2 + 4 * 16 * 16 * 4)


@pytest.mark.parametrize("batch_size, floor_ms", [(1, 1.41), (64, 16.2), (128, 20.1)])
def test_qwen3_6_preset_floor_is_the_published_one(batch_size, floor_ms):
    model = build_model(preset_config("qwen3.6-35b-a3b"), torch.bfloat16, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(34.66e9, rel=1e-3)
    floor = decode_floor(decode_traffic_of(model), batch_size, context_len=1024 + 64)
    assert floor.seconds * 1e3 == pytest.approx(floor_ms, abs=0.06)


def test_qsa_layers_read_their_selected_blocks_and_the_block_keys():
    model = build_model(preset_config("qwen4-exp", num_layers=4), torch.bfloat16, torch.device("meta"))
    traffic = decode_traffic_of(model)
    # indexer budget 2048 tokens in blocks of 4 (512 blocks) plus the query's own block; block keys
    # of 128 bf16 values per 4 tokens.
    assert traffic.kv_layers == (KVRead(2 * 2 * 256 * 2, max_tokens=513 * 4, index_bytes_per_token=128 * 2 / 4),)
    assert (traffic.num_experts, traffic.top_k) == (512, 10)
    # The PLE n-gram table lives in host memory: not HBM traffic.
    host_table = model.layers[0].ple.embedding.table.nbytes
    experts = 4 * 512 * traffic.expert_bytes
    total = sum(p.nbytes for p in model.parameters())
    assert traffic.dense_weight_bytes == total - host_table - experts - model.embed_tokens.nbytes
