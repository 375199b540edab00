"""Every op's torch reference and its Triton kernel have the same signature.

The dispatcher (``freetoken.kernels.dispatch.op``) hands the caller's arguments unchanged to
whichever implementation runs, so a parameter renamed, reordered, made keyword-only or given
another default on one side only breaks the callers of the other backend, and only on the
devices that run it. The pairs are found the way the dispatcher pairs them, in every module of
``freetoken.kernels``, so a new op is checked without being listed here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Callable

import pytest

import freetoken.kernels
from freetoken.kernels import dispatch


def _ops() -> dict[str, Callable]:
    """``{op name: public op}`` for every op defined (not merely imported) in a kernels module."""
    found: dict[str, Callable] = {}
    for info in pkgutil.iter_modules(freetoken.kernels.__path__):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{freetoken.kernels.__name__}.{info.name}")
        for name, value in vars(module).items():
            if callable(value) and hasattr(value, "reference") and value.__module__ == module.__name__:
                found[name] = value
    return found


OPS = _ops()


def _triton_twin(op: Callable) -> Callable:
    """The kernel ``op`` dispatches to on the Triton backend (the module and name ``op`` was made with)."""
    made_with = inspect.getclosurevars(op).nonlocals
    return dispatch._triton_impl(made_with["module"], made_with["name"])


def _parameters(fn: Callable) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.description, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_exported_op_is_checked():
    exported = {name for name in freetoken.kernels.__all__ if hasattr(getattr(freetoken.kernels, name), "reference")}
    assert exported and exported <= set(OPS), f"not found: {sorted(exported - set(OPS))}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_reference_and_triton_kernel_have_the_same_signature(name):
    reference, kernel = OPS[name].reference, _triton_twin(OPS[name])
    assert kernel.__name__ == name
    # Names, order, kinds and defaults first (the readable difference), then annotations too.
    assert _parameters(kernel) == _parameters(reference), (
        f"{name}: {reference.__module__} {inspect.signature(reference)} "
        f"!= {kernel.__module__} {inspect.signature(kernel)}"
    )
    assert inspect.signature(kernel) == inspect.signature(reference)
