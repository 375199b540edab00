"""Serving FreeToken with NVIDIA Triton Inference Server (Python backend, decoupled).

Inside the backend stub: ``protocol`` (the vLLM backend's inputs and outputs), ``options``
(config.pbtxt parameters), ``backend`` (what model.py delegates to: accepting requests, health),
``responses`` (the response threads: senders, cancellation), ``metrics`` (freetoken_* families),
``logs`` (Python logging into Triton's log).
``freetoken serve``: ``flags`` (its flags), ``install`` (finding tritonserver and the stub's
Python), ``repository`` (writing the model repository), ``launcher`` (running and stopping the
server). See docs/serving.md.
"""
