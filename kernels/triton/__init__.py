"""Triton kernels of FreeToken's ops: ``freetoken.kernels.triton.<module>.<op>`` has the signature
and semantics of ``freetoken.kernels.<module>.<op>_reference``. Under ``TRITON_INTERPRET=1`` (the
CPU, CI) they run through Triton's interpreter, prepared by :mod:`._interpreter`."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from freetoken.kernels.triton._interpreter import prepare_interpreter

    prepare_interpreter()
