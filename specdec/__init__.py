"""specdec: padded speculative-decoding proposers for LLM inference."""
