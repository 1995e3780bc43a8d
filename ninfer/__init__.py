"""ninfer: fast single-GPU inference for the Qwen3.5 model family."""
from ninfer.async_llm import AsyncLLM
from ninfer.llm import LLM
from ninfer.loading import load
from ninfer.outputs import Completion, CompletionOutput, Logprob, RequestOutput, StreamOutput
from ninfer.params import SamplingParams
from ninfer.perplexity import PerplexityResult, perplexity
from ninfer.runtime.structured import Constraint

__all__ = ["LLM", "AsyncLLM", "Completion", "CompletionOutput", "Constraint", "Logprob", "PerplexityResult",
           "RequestOutput", "SamplingParams", "StreamOutput", "load", "perplexity"]
__version__ = "0.1.0"
