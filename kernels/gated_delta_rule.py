"""Gated DeltaNet (gated delta rule) linear attention with a recurrent state per request.

Per value head ``h`` and token ``t`` (keys repeated from ``Hk`` to ``Hv`` heads: value head ``h``
reads key head ``h // (Hv // Hk)``), with ``q, k`` L2-normalised and ``q`` scaled by ``Dk^-1/2``:

    S = exp(g_t) · S
    S = S + k_t ⊗ (β_t · (v_t − Sᵀ k_t))
    o_t = Sᵀ q_t

``S [Dk, Dv]`` lives in float32 in a slot pool ``state [num_slots, Hv, Dk, Dv]``. Prefill runs the
chunked (WY / UT-transform) form over chunks of 64 tokens; decode runs the step above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.dispatch import op
from freetoken.kernels.prefill_snapshots import DELTA_RULE_CHUNK, PrefillSnapshots

CHUNK_SIZE = DELTA_RULE_CHUNK


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat key heads to value heads, L2-normalise in float32, scale the queries."""
    repeat = num_v_heads // k.shape[-2]
    q = l2_normalize(q.float().repeat_interleave(repeat, dim=-2))
    k = l2_normalize(k.float().repeat_interleave(repeat, dim=-2))
    return q * q.shape[-1] ** -0.5, k


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, heads first: ``q, k [H, L, Dk]``, ``v [H, L, Dv]``, ``g, beta [H, L]``, ``state [H, Dk, Dv]``.

    All float32, q/k already normalised and scaled. Returns ``(o [H, L, Dv], final state)``.
    """
    num_heads, length, _ = q.shape
    pad = (-length) % CHUNK_SIZE
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (length + pad) // CHUNK_SIZE

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(num_heads, chunks, CHUNK_SIZE, *x.shape[2:])

    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    decay = g.cumsum(-1)  # [H, N, C]: log of the decay from the chunk start to each position
    strictly_upper = torch.ones(CHUNK_SIZE, CHUNK_SIZE, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(strictly_upper, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The within-chunk delta updates form a unit lower-triangular system (the UT transform).
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_readers = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(chunks):
        corrected = new_values[:, c] - state_readers[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ corrected
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ corrected
    return out.reshape(num_heads, -1, v.shape[-1])[:, :length], state


def gated_delta_rule_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    snapshots: PrefillSnapshots | None = None,
) -> torch.Tensor:
    """Chunks of several requests: ``q, k [T, Hk, Dk]``, ``v [T, Hv, Dv]``, ``g, beta [T, Hv]``.

    Each request starts from ``state[state_slots[b]]`` and leaves its final state there. With
    ``snapshots``, a request is run as segments split at its snapshot boundaries (each chunked from
    its own start, as chunks cut there would be), and the state after each such segment is stored
    in the snapshot's row of ``state``. Returns ``o [T, Hv, Dv]`` in ``v``'s dtype.
    """
    num_v_heads = v.shape[1]
    qn, kn = _prepare(q, k, num_v_heads)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = cu_seqlens.tolist()
    cuts: dict[int, list[tuple[int, int]]] = {}  # request -> [(offset, snapshot row)], ascending
    if snapshots is not None:
        for request, offset, slot in zip(*(t.tolist() for t in (snapshots.requests, snapshots.offsets, snapshots.slots))):
            cuts.setdefault(request, []).append((offset, slot))
    for b, slot in enumerate(state_slots.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        s = state[slot].float()
        segment_start = start
        # The segments end at each snapshot boundary (the state stored in its row), then at the
        # request's end (the final state, into its own slot).
        for offset, destination in [*sorted(cuts.get(b, [])), (end - start, slot)]:
            segment_end = start + offset
            heads_first = [x[segment_start:segment_end].transpose(0, 1).float() for x in (qn, kn, v, g, beta)]
            o, s = chunked_delta_rule(*heads_first, s)
            out[segment_start:segment_end] = o.transpose(0, 1)
            state[destination] = s
            segment_start = segment_end
    return out.to(v.dtype)


def gated_delta_rule_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """One token per request: ``q, k [B, Hk, Dk]``, ``v [B, Hv, Dv]``, ``g, beta [B, Hv]``; updates the states."""
    slots = state_slots.long()
    qn, kn = _prepare(q, k, v.shape[1])
    s = state[slots].float() * g.float().exp()[..., None, None]  # [B, H, Dk, Dv]
    predicted = (s * kn[..., None]).sum(-2)
    s = s + kn[..., None] * ((v.float() - predicted) * beta.float()[..., None])[..., None, :]
    state[slots] = s.to(state.dtype)
    return (s * qn[..., None]).sum(-2).to(v.dtype)


gated_delta_rule_prefill = op("gated_delta_rule")(gated_delta_rule_prefill_reference)
gated_delta_rule_decode = op("gated_delta_rule")(gated_delta_rule_decode_reference)
