"""Choosing between the torch reference and the Triton kernel of each op.

The backend is process-wide: one engine per process owns it. ``"triton"`` on a CPU tensor runs the
kernel through Triton's interpreter, which must be switched on before the kernel modules are
imported; that is why the Triton modules are imported lazily, on first use.
"""

from __future__ import annotations

import functools
import importlib
import os
from enum import Enum
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


class KernelBackend(str, Enum):
    TORCH = "torch"
    TRITON = "triton"


_backend: KernelBackend | None = None  # None: Triton on CUDA tensors, torch elsewhere


def set_kernel_backend(backend: str | KernelBackend | None) -> None:
    """Force one implementation for every op (``"torch"`` or ``"triton"``), or ``None`` for the default."""
    global _backend
    if backend is None or backend == "auto":
        _backend = None
        return
    _backend = KernelBackend(backend)
    if _backend is KernelBackend.TRITON and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def get_kernel_backend() -> KernelBackend | None:
    return _backend


def _wants_triton(device: torch.device) -> bool:
    if _backend is None:
        return device.type == "cuda"
    return _backend is KernelBackend.TRITON


@functools.cache
def _triton_impl(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(f"freetoken.kernels.triton.{module}"), name)


def op(module: str) -> Callable[[F], F]:
    """Make ``fn`` (the torch reference) the public op, dispatching to ``triton.<module>.<fn name>``.

    The device of the first tensor argument decides the default backend.
    """

    def wrap(reference: F) -> F:
        name = reference.__name__.removesuffix("_reference")

        @functools.wraps(reference)
        def dispatch(*args, **kwargs):
            device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            if _wants_triton(device):
                return _triton_impl(module, name)(*args, **kwargs)
            return reference(*args, **kwargs)

        dispatch.__name__ = name
        dispatch.reference = reference  # type: ignore[attr-defined]
        return dispatch  # type: ignore[return-value]

    return wrap
