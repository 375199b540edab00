"""The fused decode kernels against the chains they replace, on one GPU, replayed from CUDA graphs.

    python benchmarks/fuse_decode_chain.py [--batch-sizes 1 8] [--json FILE]

Qwen3.6-35B-A3B's sizes in bf16: 30 Gated DeltaNet layers (16 key / 32 value heads of 128, conv
kernel 4) and 10 full-attention layers (16 query / 2 KV heads of 256, rotary 64, pages of 16).
Each layer has its own weights and states (a batch-1 step's GDN states alone are 120 MB, above the
L2), and one graph holds every layer's chain back to back, as a decode step's graph does, so the
time per layer includes the launch gaps inside the graph. Per batch size it prints, per layer:

- GDN: the old chain (causal_conv1d_decode, gated_delta_rule_decode_gated, gated_rms_norm: three
  launches) and ``gated_deltanet_decode`` (one) at each candidate number of warps;
- attention: the old prologue (two rms_norm, apply_rotary's two launches, store_kv: five) and
  ``norm_rotary_store_kv`` (one);

with the largest relative error of the fused outputs to the old chain's (bf16: below 1e-2).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from freetoken.kernels.rotary import build_rotary_cache
from freetoken.kernels.triton import attention, attention_prologue, conv1d, gdn_decode, norm, rotary

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
HQ, HKV, HEAD_DIM, ROTARY_DIM, PAGE = 16, 2, 256, 64, 16
GDN_LAYERS, ATTENTION_LAYERS = 30, 10
EPS = 1e-6
# Warps of gated_deltanet_decode to time (None: the module's default, 16 for 128 x 128 states).
FUSED_WARPS = [None, 8]


def randn(*shape, dtype=BF16, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=CUDA) * scale).to(dtype)


class DeltaNetLayer:
    """One GDN layer's decode inputs (strided slices of its in_proj output, as the layer passes
    them), weights and states; request ``i`` in slot ``i + 1`` (slot 0 is the scratch slot)."""

    def __init__(self, batch: int) -> None:
        channels = 2 * HK * DK + HV * DV
        packed = randn(batch, channels + HV * DV + 2 * HV)
        self.mixed_qkv = packed[:, :channels]
        self.z = packed[:, channels : channels + HV * DV].reshape(batch, HV, DV)
        self.b, self.a = packed[:, channels + HV * DV :].split([HV, HV], dim=-1)
        self.conv_weight = randn(channels, CONV_K, scale=0.5)
        self.A_log, self.dt_bias = randn(HV, scale=0.5), randn(HV)
        self.norm_weight = 1 + randn(DV, scale=0.2)
        self.conv_state = randn(batch + 1, channels, CONV_K - 1)
        self.recurrent_state = randn(batch + 1, HV, DK, DV, dtype=torch.float32, scale=0.1)
        self.slots = torch.arange(1, batch + 1, dtype=torch.int32, device=CUDA)

    def old(self) -> torch.Tensor:
        conv = conv1d.causal_conv1d_decode(self.mixed_qkv, self.conv_weight, self.conv_state, self.slots)
        q, k, v = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
        n = conv.shape[0]
        core = gdn_decode.gated_delta_rule_decode_gated(
            q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV), self.a, self.b, self.A_log, self.dt_bias,
            self.recurrent_state, self.slots,
        )
        return norm.gated_rms_norm(core, self.z, self.norm_weight, EPS)

    def fused(self) -> torch.Tensor:
        return gdn_decode.gated_deltanet_decode(
            self.mixed_qkv, self.z, self.a, self.b, self.conv_weight, self.A_log, self.dt_bias, self.norm_weight, EPS,
            self.conv_state, self.recurrent_state, self.slots,
        )

    def state_bytes(self) -> int:
        """What one step must read and write of this layer's states (the floor's main part)."""
        n = self.slots.numel()
        return 2 * n * (self.recurrent_state[0].nbytes + self.conv_state[0].nbytes)


class AttentionLayer:
    """One attention layer's prologue inputs (views of its qkv_proj output), norm weights and
    paged cache; token ``i`` at a random position, stored in a random cache location."""

    def __init__(self, batch: int, rotary_cache: torch.Tensor) -> None:
        packed = randn(batch, HQ * 2 * HEAD_DIM + 2 * HKV * HEAD_DIM)
        self.q = packed[:, : HQ * 2 * HEAD_DIM].view(batch, HQ, 2 * HEAD_DIM)[..., :HEAD_DIM]
        self.k, self.v = packed[:, HQ * 2 * HEAD_DIM :].view(batch, 2, HKV, HEAD_DIM).unbind(1)
        self.q_w, self.k_w = randn(HEAD_DIM, scale=0.2), randn(HEAD_DIM, scale=0.2)
        self.rotary_cache = rotary_cache
        self.positions = torch.randint(0, rotary_cache.shape[0], (batch,), device=CUDA)
        num_pages = 64
        self.k_cache = randn(num_pages, PAGE, HKV, HEAD_DIM)
        self.v_cache = randn(num_pages, PAGE, HKV, HEAD_DIM)
        self.locations = torch.randperm(num_pages * PAGE, device=CUDA)[:batch] + PAGE

    def old(self) -> torch.Tensor:
        q = norm.rms_norm(self.q, self.q_w, EPS, True)
        k = norm.rms_norm(self.k, self.k_w, EPS, True)
        q, k = rotary.apply_rotary(q, k, self.positions, self.rotary_cache, ROTARY_DIM)
        attention.store_kv(k, self.v, self.k_cache, self.v_cache, self.locations)
        return q

    def fused(self) -> torch.Tensor:
        return attention_prologue.norm_rotary_store_kv(
            self.q, self.k, self.v, self.q_w, self.k_w, EPS, self.positions, self.rotary_cache, ROTARY_DIM,
            self.k_cache, self.v_cache, self.locations,
        )


def graph_us_per_layer(step: Callable[[], None], num_layers: int, replays: int = 50) -> float:
    """Mean microseconds per layer of ``step`` (every layer's chain) replayed from one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels, outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * num_layers)


def max_error(layers, snapshot: Callable, restore: Callable) -> float:
    """The largest relative error of a layer's fused output to its old chain's, from equal states."""
    worst = 0.0
    for layer in layers:
        saved = snapshot(layer)
        want = layer.old().float()
        restore(layer, saved)
        got = layer.fused().float()
        restore(layer, saved)
        worst = max(worst, ((got - want).norm() / want.norm()).item())
    return worst


def gdn_rows(batch: int) -> list[dict]:
    layers = [DeltaNetLayer(batch) for _ in range(GDN_LAYERS)]
    snapshot = lambda l: (l.conv_state.clone(), l.recurrent_state.clone())  # noqa: E731
    restore = lambda l, s: (l.conv_state.copy_(s[0]), l.recurrent_state.copy_(s[1]))  # noqa: E731
    state_mb = layers[0].state_bytes() / 1e6
    old_us = graph_us_per_layer(lambda: [layer.old() for layer in layers], GDN_LAYERS)
    rows = [dict(op="gdn", batch=batch, variant="old chain (3 launches)", us_per_layer=old_us, state_mb=state_mb)]
    default = gdn_decode.NUM_WARPS
    for warps in FUSED_WARPS:
        gdn_decode.NUM_WARPS = warps
        error = max_error(layers, snapshot, restore)
        us = graph_us_per_layer(lambda: [layer.fused() for layer in layers], GDN_LAYERS)
        name = f"fused (1 launch), {warps or 'default'} warps"
        rows.append(dict(op="gdn", batch=batch, variant=name, us_per_layer=us, state_mb=state_mb, max_rel_error=error))
    gdn_decode.NUM_WARPS = default
    return rows


def attention_rows(batch: int, rotary_cache: torch.Tensor) -> list[dict]:
    layers = [AttentionLayer(batch, rotary_cache) for _ in range(ATTENTION_LAYERS)]
    snapshot = lambda l: (l.k_cache.clone(), l.v_cache.clone())  # noqa: E731
    restore = lambda l, s: (l.k_cache.copy_(s[0]), l.v_cache.copy_(s[1]))  # noqa: E731
    error = max_error(layers, snapshot, restore)
    old_us = graph_us_per_layer(lambda: [layer.old() for layer in layers], ATTENTION_LAYERS)
    fused_us = graph_us_per_layer(lambda: [layer.fused() for layer in layers], ATTENTION_LAYERS)
    return [
        dict(op="attention prologue", batch=batch, variant="old (5 launches)", us_per_layer=old_us),
        dict(op="attention prologue", batch=batch, variant="fused (1 launch)", us_per_layer=fused_us, max_rel_error=error),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rotary_cache = build_rotary_cache(ROTARY_DIM, 32768, 1e7, CUDA)
    rows: list[dict] = []
    for batch in args.batch_sizes:
        for row in gdn_rows(batch) + attention_rows(batch, rotary_cache):
            rows.append(row)
            extra = f"  max rel error {row['max_rel_error']:.2e}" if "max_rel_error" in row else ""
            if "state_mb" in row:
                extra += f"  ({row['state_mb'] / row['us_per_layer']:.2f} TB/s of state)"
            print(f"batch {batch:3d}  {row['op']:18s} {row['variant']:42s} {row['us_per_layer']:7.2f} us/layer{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
