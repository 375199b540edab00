"""Prompts sharing long prefixes, for the prefix-cache tests (CPU and GPU).

Pages hold 4 tokens (oracle.PAGE_SIZE); the system text is 24 tokens and the first question's
prompt 35, so the boundaries the scheduler snapshots (24: where a prompt leaves the cached system
text; 32: the last full page before a prompt's last token) are whole QSA blocks of every test
checkpoint (compress ratio 8 at most).
"""

from __future__ import annotations

import random

from oracle import EOS

SYSTEM = 24


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(EOS - 3) for _ in range(count)]


def shared_prefix_prompts(seed: int = 0) -> dict[str, list[int]]:
    """A, B, C: the system text and a question each; A again; D extends A."""
    rng = random.Random(seed)
    system = _tokens(rng, SYSTEM)
    a, b, c = system + _tokens(rng, 11), system + _tokens(rng, 9), system + _tokens(rng, 13)
    return {"A": a, "B": b, "C": c, "A again": list(a), "D": a + _tokens(rng, 10)}


# The prompt tokens each hits when they are sent in this order to an empty cache: B finds the
# system text cached but no snapshot there (A snapshotted at 32 only), so B snapshots at 24.
WARM_HITS = {"A": 0, "B": 0, "C": SYSTEM, "A again": 32, "D": 32}
