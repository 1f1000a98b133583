"""specdec: padded speculative-decoding proposers for LLM inference."""

from specdec.config import SpeculativeConfig
from specdec.engine.llm import LLM, RequestOutput
from specdec.engine.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
