"""jaxserve: a JAX/XLA inference engine for large language models, with an OpenAI-compatible server."""

from jaxserve.llm import LLM, CompletionOutput, RequestOutput
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.config.sampling_params import StructuredOutputsParams
from jaxserve.lora.request import LoRARequest

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "LoRARequest"]
__version__ = "0.1.0"
