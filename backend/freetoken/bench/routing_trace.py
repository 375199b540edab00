"""Seeded synthetic decode routing traces matched to published routing statistics of Qwen3 MoE models.

Random router weights route near-uniformly, which makes every expert cache look useless; real
routers are skewed per layer, more skewed within one request, and persistent from token to token.
This module draws traces from a small generative model of router logits, fitted to measurements of
real fine-grained MoE models, so that the expert cache and its eviction policy can be evaluated
without the real checkpoint (``benchmarks/expert_cache.py``; docs/benchmarks.md, "Expert cache
policies (issue 11)").

The model. For layer ``l``, batch slot ``b``, decode step ``t`` and expert ``e`` the router logit is

    logit[t, b, l, e] = G[l, e] + S[r, l, e] + X[t, b, l, e]

* ``G`` (``global_skew``) is a per-layer bias shared by all requests: some experts are popular in a
  layer whatever the prompt (expert ids are independent across layers). Its scale varies per layer
  by a log-normal factor (``layer_spread``): measured per-layer skew differs a lot (a static top-12.5%
  set covers 25% to 70% of a layer's routing in DeepSeek-V4-Flash, JustVugg/colibri#864).
* ``S`` (``request_skew``) is a bias drawn afresh for each request ``r``: which experts run hot
  depends on the prompt. A request occupies its batch slot for ``request_tokens`` decode steps; slots
  are staggered so that requests of a batch start at different steps.
* ``X`` is per-token noise of unit variance over the steps of one request: consecutive tokens have
  similar hidden states, so similar logits. It is the sum of a fast AR(1) process (coefficient
  ``persistence``) and a slow drift (coefficient ``drift_persistence``, ``drift_share`` of the
  variance): one time scale cannot give both the measured next-token reuse and the reuse within
  eight tokens.

The ``top_k`` largest logits are the routed experts, in descending order like a router's top-k.

Fitted (``trace_statistics``; ``benchmarks/expert_cache.py --calibrate``) at the Qwen3-30B-A3B shape
(48 layers, 128 experts, top-8) to these published decode measurements:

* Temporal locality: 45% of a token's experts were routed for the previous token as well, 80% within
  the last eight tokens, median reuse distance 2 tokens (three prompts x 512 tokens;
  https://github.com/kekzl/imp/pull/1359).
* Per-request versus corpus skew at 40% residency: a resident set chosen per prompt covers 92.1% of
  that prompt's routing; a set pooled from other prompts covers 67.6-72.6% of a held-out prompt
  (nine unrelated prompts x 512 tokens; https://github.com/kekzl/imp/pull/1358).

and checked (not fitted) against:

* LRU at 40% residency: 90.0-95.3% steady-state hits, 0.38-0.80 new experts per layer per token
  (https://github.com/kekzl/imp/pull/1359); LRU with 73 of 128 slots per layer, 256 cold decode
  tokens: 74.1% (https://github.com/kekzl/imp/pull/1374).
* Corpus skew: 90% of a layer's routing needs 45-51% of its experts, the top expert takes 4.3-6.3%
  of it (Qwen3-30B-A3B, llama-imatrix counts;
  https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/).
* 512 experts top-10 with a shared expert, 48 layers, 36.6% of experts resident: 5.5-7.8% misses
  per decode window (Qwen3.8-Flash-Next; https://github.com/FlashML-org/FreeToken/pull/231).

Qwen3.6-35B-A3B (256 experts, top-8, shared expert) and Qwen4-Exp (512, top-10) use the same logit
scales: no per-token routing trace of them is published, and models with a shared expert show
somewhat less local consistency (Liang et al., "Not All Models Suit Expert Offloading",
https://arxiv.org/abs/2505.16056), so these traces may flatter the cache a little there.

Not modelled: prefill (a long chunk touches most experts, https://github.com/ggml-org/llama.cpp/pull/15346)
and cross-layer correlation of a token's routing (which next-layer predictors such as Fate exploit,
https://arxiv.org/abs/2502.12224): the layers of one token here are independent given its request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class RoutingModel:
    """Scales of the router-logit model, in units of the per-token noise's standard deviation."""

    global_skew: float = 0.55
    request_skew: float = 0.7
    persistence: float = 0.2
    drift_share: float = 0.45
    drift_persistence: float = 0.95
    layer_spread: float = 0.3
    request_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("global_skew", "request_skew", "layer_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoutingModel.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("persistence", "drift_persistence"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"RoutingModel.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.drift_share <= 1:
            raise ValueError(f"RoutingModel.drift_share must be in [0, 1], got {self.drift_share}")
        if self.request_tokens < 1:
            raise ValueError(f"RoutingModel.request_tokens must be >= 1, got {self.request_tokens}")


QWEN3_ROUTING = RoutingModel()


def _check_shape(num_layers: int, num_experts: int, top_k: int) -> None:
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def _layer_bias(rng: np.random.Generator, num_layers: int, num_experts: int, model: RoutingModel) -> np.ndarray:
    """``G``: the per-layer popularity every request shares, float32 ``[layers, experts]``."""
    scale = model.global_skew * np.exp(model.layer_spread * rng.standard_normal((num_layers, 1)))
    return (scale * rng.standard_normal((num_layers, num_experts))).astype(np.float32)


class _AR1:
    """Unit-variance AR(1) noise per (batch slot, layer, expert); a slot restarts from the stationary law."""

    def __init__(self, coefficient: float, shape: tuple[int, ...]) -> None:
        self.a = np.float32(coefficient)
        self.innovation = np.float32(np.sqrt(1.0 - coefficient**2))
        self.x = np.zeros(shape, np.float32)

    def step(self, rng: np.random.Generator, fresh: np.ndarray) -> np.ndarray:
        z = rng.standard_normal(self.x.shape, dtype=np.float32)
        self.x = np.where(fresh[:, None, None], z, self.a * self.x + self.innovation * z)
        return self.x


def generate_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    steps: int,
    batch: int = 1,
    seed: int = 0,
    model: RoutingModel = QWEN3_ROUTING,
) -> np.ndarray:
    """Routed expert ids of ``steps`` decode steps, int32 ``[steps, batch, layers, top_k]``.

    Batch slot ``b`` starts a new request every ``model.request_tokens`` steps, offset by
    ``b * request_tokens // batch`` steps; the same ``seed`` gives the same trace.
    """
    _check_shape(num_layers, num_experts, top_k)
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got steps={steps}, batch={batch}")
    rng = np.random.default_rng(seed)
    bias = _layer_bias(rng, num_layers, num_experts, model)
    shape = (batch, num_layers, num_experts)
    offsets = np.arange(batch) * model.request_tokens // batch
    request = np.empty(shape, np.float32)
    fast = _AR1(model.persistence, shape)
    drift = _AR1(model.drift_persistence, shape)
    w_fast, w_drift = np.float32(np.sqrt(1.0 - model.drift_share)), np.float32(np.sqrt(model.drift_share))
    out = np.empty((steps, batch, num_layers, top_k), np.int32)
    for t in range(steps):
        fresh = (t + offsets) % model.request_tokens == 0
        if t == 0:
            fresh[:] = True
        for b in np.flatnonzero(fresh):
            request[b] = model.request_skew * rng.standard_normal(shape[1:])
        logits = bias + request + w_fast * fast.step(rng, fresh) + w_drift * drift.step(rng, fresh)
        top = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1)
        out[t] = np.take_along_axis(top, order, axis=-1)
    return out


def router_logit_bias(
    num_layers: int,
    num_experts: int,
    seed: int = 0,
    model: RoutingModel = QWEN3_ROUTING,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """Per-layer bias ``[layers, experts]`` to add to a random-weight router's logits.

    With it a ``--load-format dummy`` model routes with this model's corpus-level skew (``G``, the
    same as ``generate_trace`` with the same seed). ``logit_std`` is the standard deviation of the
    dummy router's logits across experts for one token (measure it on one forward pass): that spread
    stands for the request and token terms ``S + X`` of the model, whose joint standard deviation is
    ``sqrt(1 + request_skew**2)``, so the bias is rescaled to keep the same ratio. The dummy router
    has no request or token persistence, so its cache hit rate is a lower bound of the trace's.
    """
    _check_shape(num_layers, num_experts, 1)
    if logit_std <= 0:
        raise ValueError(f"logit_std must be > 0, got {logit_std}")
    bias = _layer_bias(np.random.default_rng(seed), num_layers, num_experts, model)
    return torch.from_numpy(bias * np.float32(logit_std / np.sqrt(1.0 + model.request_skew**2)))


def bias_routers(model: nn.Module, seed: int = 0) -> torch.Tensor:
    """Give every ``SparseMoE`` of a random-weight ``model`` (``load_format="dummy"``, whose router
    logits are about N(0, 1) per expert: ``models.random_weights``) its layer's
    ``router_logit_bias``, so a benchmark routes with the fitted corpus skew; returns the bias
    ``[moe layers, experts]``. CUDA graphs captured before must be captured again."""
    from freetoken.layers.moe import SparseMoE

    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not blocks:
        raise ValueError("bias_routers: the model has no sparse MoE block")
    bias = router_logit_bias(len(blocks), blocks[0].num_experts, seed)
    for block, layer_bias in zip(blocks, bias):
        block.router_bias = layer_bias.to(block.gate_weight.device, block.gate_weight.dtype)
    return bias


TRACE_LOGIT_SCALE = 3.0  # trace logits over the random router's unit spread (``TraceRouting``)


class TraceRouting:
    """Drive a random-weight ``model``'s routers (batch 1) along the routing model, step by step,
    so that a ``--load-format dummy`` benchmark routes its decode as ``generate_trace`` does: with
    the corpus skew ``G``, a request skew ``S`` drawn afresh for each new request, and the
    persistent per-token noise ``X``, not only ``G`` (``bias_routers``).

    Every ``SparseMoE``'s ``router_bias`` becomes a row of one persistent device buffer ``[layers,
    experts]``; ``before(plan)`` (called before each engine step is launched) writes the next logits
    into it with one asynchronous copy on the compute stream, so CUDA graph replays read them too
    (graphs captured before must be captured again). A decode step gets ``G + S + X_t`` (``X``
    advanced by one token); a step with prompt chunks ``G + S`` (the chunk's tokens differ by the
    random routers' own noise, as the prompt's tokens would; a chunk that starts a prompt starts a
    new request: new ``S``, ``X`` restarted). The logits are scaled by ``TRACE_LOGIT_SCALE`` over the
    random router's unit spread, which then adds a little token noise: persistence a little below the
    trace's (a tenth of ``X``'s variance at 3)."""

    def __init__(self, model: nn.Module, seed: int = 0, routing: RoutingModel = QWEN3_ROUTING,
                 scale: float = TRACE_LOGIT_SCALE) -> None:
        from freetoken.layers.moe import SparseMoE

        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if not blocks:
            raise ValueError("TraceRouting: the model has no sparse MoE block")
        layers, experts = len(blocks), blocks[0].num_experts
        weight = blocks[0].gate_weight
        self.buffer = torch.zeros(layers, experts, dtype=weight.dtype, device=weight.device)
        for block, row in zip(blocks, self.buffer):
            block.router_bias = row
        self.routing, self.scale = routing, np.float32(scale)
        self.rng = np.random.default_rng(seed)
        self.bias = _layer_bias(self.rng, layers, experts, routing)
        self.shape = (1, layers, experts)
        self.request = np.zeros(self.shape[1:], np.float32)
        self.fast = _AR1(routing.persistence, self.shape)
        self.drift = _AR1(routing.drift_persistence, self.shape)
        self._fresh = True  # the next decode step restarts X
        self.steps = 0  # decode steps driven

    def before(self, plan) -> None:
        """Set the routers' bias for ``plan`` (an ``engine`` ``StepPlan``), before it is launched."""
        if any(row.num_new > 1 or row.num_computed == 0 for row in plan.rows):  # prompt chunks
            if any(row.num_computed == 0 for row in plan.rows):
                self.request = self.routing.request_skew * self.rng.standard_normal(self.shape[1:], dtype=np.float32)
                self._fresh = True
            logits = self.bias + self.request
        else:
            fresh = np.array([self._fresh])
            self._fresh = False
            share = self.routing.drift_share
            noise = (np.float32(np.sqrt(1.0 - share)) * self.fast.step(self.rng, fresh)
                     + np.float32(np.sqrt(share)) * self.drift.step(self.rng, fresh))[0]
            logits = self.bias + self.request + noise
            self.steps += 1
        host = torch.from_numpy(self.scale * logits).to(self.buffer.dtype)
        if self.buffer.device.type == "cuda":
            host = host.pin_memory()
        self.buffer.copy_(host, non_blocking=host.is_pinned())


def _request_segments(trace: np.ndarray, request_tokens: int):
    """(batch slot, start, stop) of each whole or partial request in ``trace``."""
    steps, batch = trace.shape[:2]
    for b in range(batch):
        offset = b * request_tokens // batch
        first = (request_tokens - offset) % request_tokens
        bounds = [0] + list(range(first if first else request_tokens, steps, request_tokens)) + [steps]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            if stop > start:
                yield b, start, stop


def _coverage(counts: np.ndarray, chosen: np.ndarray) -> float:
    """Share of ``counts`` (``[layers, experts]``) routed to the ``chosen`` experts of each layer."""
    return float(np.take_along_axis(counts, chosen, axis=-1).sum() / counts.sum())


def _counts(trace: np.ndarray, num_experts: int) -> np.ndarray:
    """Routing counts ``[layers, experts]`` of a ``[steps, layers, top_k]`` trace."""
    layers = trace.shape[1]
    flat = trace + (np.arange(layers) * num_experts)[None, :, None]
    return np.bincount(flat.ravel(), minlength=layers * num_experts).reshape(layers, num_experts).astype(np.float64)


def trace_statistics(
    trace: np.ndarray, num_experts: int, request_tokens: int, residency: float = 0.4
) -> dict[str, float]:
    """The statistics the model is fitted to and checked against (see the module docstring).

    ``next_token_repeat`` / ``repeat_within_8``: share of a token's experts (per layer) routed for
    the previous token / one of the previous eight tokens of the same request. ``request_coverage``:
    share of a request's routing covered by its own hottest ``residency`` of experts per layer;
    ``heldout_coverage``: the same with the set pooled from the other requests (even requests
    calibrate, odd ones are scored). ``experts_for_90``: fraction of a layer's experts, hottest
    first over the whole trace, needed for 90% of its routing; ``top_expert_share`` the hottest
    expert's share, both averaged over layers.
    """
    k = trace.shape[-1]
    keep = max(1, round(residency * num_experts))
    segments = [trace[start:stop, b] for b, start, stop in _request_segments(trace, request_tokens)]
    same, within8, total = 0, 0, 0
    for seg in segments:
        hot = np.zeros((seg.shape[1], num_experts), np.int64)  # last step each expert was routed
        hot[:] = -(10**9)
        for t in range(seg.shape[0]):
            last = np.take_along_axis(hot, seg[t], axis=-1)
            if t > 0:
                same += int((last == t - 1).sum())
                within8 += int((last >= t - 8).sum())
                total += seg[t].size
            np.put_along_axis(hot, seg[t], t, axis=-1)
    request_cov = []
    for seg in segments:
        counts = _counts(seg, num_experts)
        request_cov.append(_coverage(counts, np.argsort(-counts, axis=-1)[:, :keep]))
    calib = sum(_counts(s, num_experts) for s in segments[0::2])
    heldout = [_coverage(_counts(s, num_experts), np.argsort(-calib, axis=-1)[:, :keep]) for s in segments[1::2]]
    whole = _counts(trace.reshape(-1, *trace.shape[2:]), num_experts)
    share = -np.sort(-whole, axis=-1) / whole.sum(axis=-1, keepdims=True)
    need90 = (np.cumsum(share, axis=-1) < 0.9).sum(axis=-1) + 1
    return {
        "next_token_repeat": same / max(total, 1),
        "repeat_within_8": within8 / max(total, 1),
        "request_coverage": float(np.mean(request_cov)),
        "heldout_coverage": float(np.mean(heldout)) if heldout else float("nan"),
        "experts_for_90": float(np.mean(need90) / num_experts),
        "top_expert_share": float(share[:, 0].mean()),
        "uniform_repeat": k / num_experts,
    }
