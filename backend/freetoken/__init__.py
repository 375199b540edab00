"""FreeToken: an inference engine for hybrid mixture-of-experts models, served by Triton.

``LLM`` is imported on first use (PEP 562), so that ``import freetoken`` and the ``freetoken``
command's ``--help`` do not load torch and transformers.
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any


def _drop_checkout_root_from_path() -> None:
    """``python -m freetoken.cli`` (or ``python -m pytest``) run in a source checkout puts the
    checkout's root first on ``sys.path``, where its top-level ``kernels/`` (installed as
    ``freetoken.kernels``) shadows the Hugging Face ``kernels`` package that transformers >= 5.25
    imports. Everything of the checkout that runs is reachable through the installed package, so
    the root leaves the path. A no-op outside a checkout (an installed wheel, a site folder)."""
    root = Path(__file__).resolve().parent.parent.parent  # <root>/backend/freetoken
    if (root / "kernels" / "__init__.py").is_file() and (root / "backend" / "freetoken").is_dir():
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != root]


_drop_checkout_root_from_path()

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.core import FinishReason, RequestOutput, SamplingParams  # noqa: E402

if TYPE_CHECKING:
    from freetoken.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
