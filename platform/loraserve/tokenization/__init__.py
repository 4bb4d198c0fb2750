"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from loraserve.tokenization.controller import TokenizationController

__all__ = ["TokenizationController"]
