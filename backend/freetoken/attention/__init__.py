"""Attention variants beyond the dense paged attention of ``layers.attention``."""
