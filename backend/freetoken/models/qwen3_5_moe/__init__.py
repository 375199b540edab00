from freetoken.models.qwen3_5_moe.model import Qwen3_5MoeModel

__all__ = ["Qwen3_5MoeModel"]
