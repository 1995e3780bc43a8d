"""ninfer: fast single-GPU inference for the Qwen3.5 model family."""
from ninfer.llm import LLM, Completion, load
from ninfer.perplexity import PerplexityResult, perplexity
from ninfer.runtime.structured import Constraint

__all__ = ["LLM", "Completion", "Constraint", "PerplexityResult", "load", "perplexity"]
__version__ = "0.1.0"
