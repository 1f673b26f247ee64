"""flashtree: lossless speculative decoding with DFlash drafters and DDTree draft trees."""

from flashtree.llm import LLM, RequestOutput
from flashtree.sampling import SamplingParams
from flashtree.version import __version__

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
