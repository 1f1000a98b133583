"""N-gram (prompt lookup) drafting: the request's own tokens predict its next ones.

No head and no draft step: after each step, on the host, the proposer looks for the longest
n-gram (``prompt_lookup_min`` <= n <= ``prompt_lookup_max``) that ends the request's tokens
(prompt and output so far) and also occurs earlier, and proposes the tokens that followed its
earliest occurrence, up to K (vLLM's rule). Example: tokens [1, 2, 3, 4, 1, 2, 3], n in 1..3,
K = 2 -> [1, 2, 3] occurred at 0 -> drafts [4, 1]. No match -> no drafts.

Each request gets 0..K drafts. The padded engine still feeds every decode 1 + K tokens (the
drafts, then filler), so the step keeps its captured shape while verification accepts only
within each request's own count (``ScheduledRequest.num_filler``).
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.config import SpeculativeConfig
from specdec.proposers.base import HostProposer


def ngram_drafts(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafts for a request whose tokens are ``token_ids`` [L] (vLLM's rule):
    the longest n in [min_n, max_n] whose last-n-token suffix also starts at some i < L - n,
    the earliest such i; -> token_ids[i + n : i + n + k] (fewer near the end; [] if none)."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(token_ids[:length - 1], n)  # starts 0 .. L - n - 1
        hits = np.flatnonzero((windows == token_ids[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start:start + k].tolist()
    return []


class NgramProposer(HostProposer):
    """Drafts from the request's tokens (``ngram_drafts``), on the host, after each step."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int):
        super().__init__(config, max_model_len=max_model_len)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def drafts(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """The next step's drafts of a request with these tokens: at most ``k`` (<= K; 0:
        none, no search), and none past max_model_len."""
        k = min(k, self.num_speculative_tokens, self.max_model_len - len(token_ids))
        if k <= 0:
            return []
        return ngram_drafts(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, k)
