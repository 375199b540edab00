from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.tokenizer.loading import load_tokenizer

__all__ = ["IncrementalDetokenizer", "load_tokenizer"]
