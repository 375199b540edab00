"""Attention backends and the metadata they prepare for a step (kept apart from the layers: the
attention layers themselves, dense and QSA-indexed, are in ``freetoken.layers``)."""
