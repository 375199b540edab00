"""Time issue 9's L2 prefetches on Qwen3.6-35B-A3B Gated DeltaNet decoder layers at batch 1, each
variant against none, on one GPU:

    python benchmarks/prefetch_sweep.py [--layers 8] [--only NAME ...] [--json FILE]

The layers are the model's own ``DecoderLayer`` (input norm + in_proj with the conv step, the delta
rule, the gated norm, out_proj, the router, the MoE decode block), random bf16 weights, distinct per
layer (8 layers: 4.3 GB, far more than the 50 MB L2), one decode row, captured back to back in one
CUDA graph with programmatic dependent launch as the step runs them; us per layer, the median
replay. Variants: the switches of ``layers.weight_prefetch`` (which weights are prefetched after
the input projection, ``CHAINED``), ``kernels.triton.moe_decode.PREFETCH_DOWN`` and
``kernels.triton.l2_prefetch.BULK``. Every variant's output must equal the baseline's bit for bit
(the prefetches are hints); a row says so. The end-to-end A/B is ``b1_fusions_ab.py --on ...``.
"""

from __future__ import annotations

import argparse
import json

import torch

from graph_timing import graph_us

HIDDEN, EXPERTS, TOP_K, INTER, EPS = 2048, 256, 8, 512, 1e-6
SITES = ("OUT_PROJ", "ROUTER", "SHARED")
# name -> (weight_prefetch sites on, CHAINED, PREFETCH_DOWN, BULK)
VARIANTS = {
    "none": ((), False, False, True),
    "out_proj": (("OUT_PROJ",), False, False, True),
    "out_proj+router": (("OUT_PROJ", "ROUTER"), False, False, True),
    "sites": (SITES, False, False, True),
    "sites chained": (SITES, True, False, True),
    "sites line": (SITES, False, False, False),
    "down": ((), False, True, True),
    "down line": ((), False, True, False),
    "sites+down": (SITES, False, True, True),
    "sites chained+down": (SITES, True, True, True),
}


def _layers(count: int, rng: torch.Generator):
    from freetoken.layers.gated_deltanet import DeltaNetSizes, GatedDeltaNet
    from freetoken.layers.moe import SparseMoE
    from freetoken.layers.weight_prefetch import WeightPrefetch
    from freetoken.models.qwen3_5_moe.model import DecoderLayer

    prefetch = WeightPrefetch()
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    layers = []
    for _ in range(count):
        layer = DecoderLayer(GatedDeltaNet(DeltaNetSizes(HIDDEN, 16, 32, 128, 128, 4, EPS)),
                             SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, INTER), HIDDEN, EPS, prefetch)
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=rng, device="cuda") * p.shape[-1] ** -0.5)
        layer.mixer.A_log.data.copy_(torch.rand(layer.mixer.A_log.shape, generator=rng, device="cuda").log())
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.mul_(0.2 * HIDDEN**0.5)
        shapes = layer.mixer.state_shapes(2, torch.bfloat16)
        layer.mixer.conv_state = torch.randn(shapes["conv_state"][0], generator=rng, device="cuda") * 0.1
        layer.mixer.recurrent_state = torch.randn(shapes["recurrent_state"][0], generator=rng, device="cuda",
                                                  dtype=torch.float32) * 0.1
        layers.append(layer)
    torch.set_default_dtype(torch.float32)
    return layers, prefetch


def _batch():
    from freetoken.batch import ForwardBatch

    zeros = torch.zeros(1, dtype=torch.int64, device="cuda")
    return ForwardBatch(
        input_ids=zeros, positions=zeros, cu_seqlens=torch.arange(2, dtype=torch.int32, device="cuda"),
        seq_lens=torch.ones(1, dtype=torch.int32, device="cuda"),
        page_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"), kv_locations=zeros,
        state_slots=torch.ones(1, dtype=torch.int32, device="cuda"), logits_indices=zeros, num_decodes=1,
        max_query_len=1, max_seq_len=16, query_lens=[1],
    )


def _set(sites, chained: bool, down: bool, bulk: bool) -> None:
    from freetoken.kernels.triton import l2_prefetch, moe_decode
    from freetoken.layers import weight_prefetch

    for site in SITES:
        setattr(weight_prefetch, site, site in sites)
    weight_prefetch.CHAINED = chained
    moe_decode.PREFETCH_DOWN = down
    l2_prefetch.BULK = bulk


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = torch.Generator(device="cuda").manual_seed(0)
    layers, prefetch = _layers(args.layers, rng)
    batch = _batch()
    x = torch.randn(1, HIDDEN, generator=rng, device="cuda").to(torch.bfloat16)
    states = [(l.mixer.conv_state.clone(), l.mixer.recurrent_state.clone()) for l in layers]

    def step():
        hidden, residual = x, None
        for layer in layers:
            hidden, residual = layer(hidden, residual, batch)
        prefetch.join()
        return hidden

    def from_start():
        for layer, (conv, rec) in zip(layers, states):
            layer.mixer.conv_state.copy_(conv)
            layer.mixer.recurrent_state.copy_(rec)
        return step()

    rows, baseline = [], None
    with torch.inference_mode():
        for name in ["none", *[v for v in args.only if v != "none"]]:
            _set(*VARIANTS[name])
            out = from_start().clone()
            baseline = out if baseline is None else baseline
            us = graph_us(step, len(layers))
            row = dict(variant=name, us_per_layer=round(us, 2), same_bits=bool(torch.equal(out, baseline)))
            row["saving_us_per_step"] = round((rows[0]["us_per_layer"] - us) * 40, 1) if rows else 0.0
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
