"""Benchmark clients: ``loadgen`` (closed-loop load over gRPC streams against a served model)."""
