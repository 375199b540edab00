"""FreeToken: an inference engine for hybrid mixture-of-experts models, served by Triton."""

from freetoken.config import EngineConfig
from freetoken.core import FinishReason, RequestOutput, SamplingParams
from freetoken.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "FinishReason"]
__version__ = "0.1.0"
