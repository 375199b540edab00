"""Session fixtures: the demo checkpoint (tests/oracle.py builds every checkpoint); start-up objects
unfrozen after each test."""

from __future__ import annotations

import gc
from pathlib import Path

# First: importing freetoken drops the checkout's root, which ``python -m pytest`` puts on sys.path,
# before anything imports transformers (its ``kernels`` import would find the top-level kernels/).
import freetoken  # noqa: F401  isort: skip
import pytest

from oracle import DEMO, checkpoint


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The Qwen3.5 demo model's random float32 checkpoint."""
    return checkpoint(DEMO["qwen3_5_moe"])


@pytest.fixture(autouse=True)
def _unfreeze_garbage_collector():
    """Every ``Runtime`` freezes what is alive at its start (``runtime.freeze_startup_objects``): a
    server keeps it for its life, but a test's engine dies with the test, and frozen objects in
    reference cycles are never collected. Unfrozen after each test, they can be."""
    yield
    gc.unfreeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test argument that names no fixture and no ``parametrize`` argument (say, the decorators
    left on a helper put between them and the test) fails only at the test's setup, which a GPU
    test reaches only on the GPU: refuse the run at collection instead, on every machine."""
    unresolved = []
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        missing = [name for name in info.argnames if name not in info.name2fixturedefs and name not in params]
        if missing:
            unresolved.append(f"{item.nodeid}: {', '.join(missing)}")
    if unresolved:
        raise pytest.UsageError("test arguments with no fixture or parametrize: " + "; ".join(unresolved))
