"""Benchmarks: ``offline`` (``freetoken bench``: decode and prefill through ``LLM.generate`` against the
HBM floor, on a model directory or a preset of a real architecture with random weights) and
``loadgen`` (closed-loop load over gRPC streams against a served model)."""
