"""FreeToken: an inference engine for hybrid mixture-of-experts models, served by Triton.

``LLM`` is imported on first use (PEP 562), so that ``import freetoken`` and the ``freetoken``
command's ``--help`` do not load torch and transformers.
"""

from typing import TYPE_CHECKING, Any

from freetoken.config import EngineConfig
from freetoken.core import FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from freetoken.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
