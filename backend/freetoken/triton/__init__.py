"""Serving FreeToken with NVIDIA Triton Inference Server (Python backend, decoupled).

``protocol`` (the vLLM backend's inputs and outputs), ``options`` (config.pbtxt parameters),
``backend`` (what model.py delegates to: request states, response threads, cancellation, health),
``metrics`` (freetoken_* families), ``launcher`` (``freetoken serve``). See docs/serving.md.
"""
