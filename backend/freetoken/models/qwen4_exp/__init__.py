from freetoken.models.qwen4_exp.model import Qwen4ExpModel

__all__ = ["Qwen4ExpModel"]
