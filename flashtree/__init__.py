"""flashtree: lossless speculative decoding with DFlash drafters and DDTree draft trees."""

from flashtree.llm import LLM, RequestOutput
from flashtree.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
