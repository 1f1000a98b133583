"""Continuous batching with a per-step token budget and chunked prefill.

Each step, running decode requests come first (1 + their drafts each; with ``fill_drafts``
1 + K each, filler after fewer drafts, so the padded step keeps its uniform shape), then
prefill chunks fill what is left of the budget. K is the step's (``step_k``): with a K
schedule or policy (``pick_k``) it follows the step's batch size, drafts past it are not
verified. A prefill chunk that stops short of the prompt's end makes a *discarded* request:
its sampled token is junk, but the drafter still runs on it.

Without ``pack_prefill`` a step that ends a prompt holds no chunk that stops short of another
prompt's end: that chunk would make the step, and so the first token of the prompt it ends,
wait for work done for a later prompt (on a CPU a step's time grows with its tokens).
Example, budget 256, prompts A and B of 190 new tokens each: packed, step 1 is A's 190 and
B's first 66 tokens, so A's first token comes after 256 tokens' work and B's after 512;
unpacked, step 1 is A's 190 and step 2 B's 190 (first tokens after 190 and 380).

With prefix caching (the allocator's ``caching``), an admitted request first takes the cached
blocks of its prompt's longest cached prefix (``admit``): those tokens count as computed, and its
first chunk starts after them; at least its last prompt token is always computed (its logits are
sampled). A running request's final full blocks are registered at the start of each schedule and
when it finishes (not after a failed step: reason "error"). A target with linear attention
(the allocator's ``snapshots``): a step stages each request's state after the last block
boundary its tokens cross (``linear_state``); registering then snapshots it for that block's
entry when the boundary's tokens are final (``snapshot_at``, set by the engine;
``state_saves``), and a hit restores the snapshot of its last block into the request's row
(``state_restores``). The engine runs both lists before the step's forward.
"""

from collections import deque
from dataclasses import dataclass

from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.sequence import Request, Status


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens fed to the target this step
    spec_token_ids: list[int]  # drafts verified this step (fed after the last known token)
    num_filler: int = 0  # tokens fed after the drafts (never accepted): 1 + K fed in all

    def num_computed(self, accepted: int) -> int:
        """Tokens this step computes for good when ``accepted`` of its drafts are kept: the
        fed tokens less the filler and the rejected drafts."""
        return self.num_tokens - self.num_filler - (len(self.spec_token_ids) - accepted)

    @property
    def is_discarded(self) -> bool:
        """The chunk stops short of the known tokens: nothing is sampled for it."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens < r.num_tokens


def is_uniform_decode(scheduled: list[ScheduledRequest], k: int) -> bool:
    """Every request decodes with 1 + ``k`` tokens (its drafts, then filler): the step a
    capture bucket holds (greedy or not)."""
    return all(s.num_tokens == 1 + k == 1 + len(s.spec_token_ids) + s.num_filler
               for s in scheduled)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 allocator: BlockAllocator, num_speculative_tokens: int,
                 fill_drafts: bool = False, on_finish=None, pick_k=None,
                 reserve_ahead: int = 0, draft_rows: int | None = None,
                 pack_prefill: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.num_speculative_tokens = num_speculative_tokens
        # the drafter's K/V rows past a step's tokens: K (a chain's loop), or a tree's depth
        # and its head rows (its first pass ends up to depth rows later)
        self.draft_rows = num_speculative_tokens if draft_rows is None else draft_rows
        self.fill_drafts = fill_drafts  # a decode with < K drafts still feeds 1 + K tokens
        self.on_finish = on_finish  # called with each running request that ends, any reason
        # (batch size, decode-only step) -> the step's K (None: num_speculative_tokens
        # every step)
        self.pick_k = pick_k
        # KV slots reserved past a step's tokens and its drafts: async scheduling runs one
        # more decode (1 + K tokens) before the host reads the step
        self.reserve_ahead = reserve_ahead
        self.pack_prefill = pack_prefill  # False: a step that ends a prompt starts no other
        self.step_k = num_speculative_tokens  # the last schedule()'s K
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.scheduled: list[ScheduledRequest] = []  # the last schedule()'s requests
        # linear attention's state copies due before the next step: (row, snapshot) saves,
        # then (snapshot, row) restores (``take_state_copies``)
        self.state_saves: list[tuple[int, int]] = []
        self.state_restores: list[tuple[int, int]] = []
        # the last schedule()'s prefix-cache lookups: prompt tokens queried, tokens hit
        self.cache_queries = self.cache_hits = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        # kept (and filled as it is built) so that a failed step knows whom it touched
        self.scheduled = scheduled = []
        k = self.step_k = self.pick_step_k()
        self.cache_queries = self.cache_hits = 0
        for req in self.running:
            self.register(req)
        ends_prompt = False  # a chunk of this step ends its prompt
        for req in self.running:
            if budget == 0:
                break
            filler = 0
            if req.is_prefilling:  # unpacked, the one running prompt not ended (if any)
                left = req.num_tokens - req.num_computed_tokens
                n = min(left, budget)
                ends_prompt |= n == left
                spec = []
            else:
                # never verify drafts past max_model_len: the target has no room for them
                fits = min(self.max_model_len - req.num_tokens, budget - 1)
                spec = req.spec_token_ids[:max(0, min(fits, k))]
                if self.fill_drafts and fits >= k:
                    filler = k - len(spec)
                n = 1 + len(spec) + filler
            scheduled.append(ScheduledRequest(req, n, spec, filler))
            self.reserve(req, n)
            budget -= n
        while self.waiting and budget > 0 and self.free_rows:
            if ends_prompt and not self.pack_prefill and self.prefill_left(
                    self.waiting[0]) > budget:
                break  # unpacked: it waits for a step that ends no other prompt
            req = self.waiting.popleft()
            req.row = self.free_rows.pop()
            req.status = Status.RUNNING
            self.running.append(req)
            self.admit(req)
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget)
            ends_prompt |= n == left
            scheduled.append(ScheduledRequest(req, n, []))
            self.reserve(req, n)
            budget -= n
        return scheduled

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """-> (saves, restores) due before the next step, and forgets them."""
        copies = self.state_saves, self.state_restores
        self.state_saves, self.state_restores = [], []
        return copies

    def cut_to_k(self, k: int) -> None:
        """The last schedule's decodes verify at most ``k`` drafts (k < ``step_k``: the DP
        ranks agreed on a smaller K); a decode filled up to 1 + step_k is filled up to 1 + k.
        Only tokens go: the KV blocks reserved stay."""
        for s in self.scheduled:
            if not (s.spec_token_ids or s.num_filler):
                continue
            filled = s.num_filler > 0 or (self.fill_drafts
                                          and len(s.spec_token_ids) == self.step_k)
            s.spec_token_ids = s.spec_token_ids[:k]
            s.num_filler = k - len(s.spec_token_ids) if filled else 0
            s.num_tokens = 1 + len(s.spec_token_ids) + s.num_filler
        self.step_k = k

    def pick_step_k(self) -> int:
        """The step's K from its batch size: the running requests and the waiting ones that
        free rows admit (what the step runs unless the token budget stops admission first);
        decode-only: no request of it prefills."""
        if self.pick_k is None:
            return self.num_speculative_tokens
        admitted = min(len(self.waiting), len(self.free_rows))
        decode_only = not admitted and not any(r.is_prefilling for r in self.running)
        return self.pick_k(len(self.running) + admitted, decode_only)

    def admit(self, req: Request) -> None:
        """A newly running request takes the cached blocks of its prompt's longest cached
        prefix, keeping its last token (and a drafter's lookahead token after each block) to
        compute. A request asking for prompt log-probabilities reads nothing from the cache
        (they are computed for every prompt position, as vLLM)."""
        a = self.allocator
        if not self._reads_cache(req):
            return
        req.block_ids, req.block_entries = a.hit(req.token_ids, self._usable_blocks(req))
        req.num_computed_tokens = req.num_cached_tokens = len(req.block_ids) * a.block_size
        if a.snapshots and req.block_entries:
            self.state_restores.append((a.snapshot_of[req.block_entries[-1]], req.row))
        self.cache_queries += req.num_tokens
        self.cache_hits += req.num_cached_tokens

    def _reads_cache(self, req: Request) -> bool:
        """Whether admitting ``req`` looks its prompt up in the prefix cache."""
        return self.allocator.caching and req.params.prompt_logprobs is None

    def _usable_blocks(self, req: Request) -> int:
        """The most full blocks of the prompt a hit may take: its last token (and a
        drafter's lookahead token after each block) stays to compute."""
        a = self.allocator
        return (req.num_tokens - max(a.lookahead, 1)) // a.block_size

    def prefill_left(self, req: Request) -> int:
        """The prompt tokens a waiting request would compute if ``admit`` ran now (after the
        prefix the cache holds; nothing held)."""
        if not self._reads_cache(req):
            return req.num_tokens - req.num_computed_tokens
        blocks, _ = self.allocator.lookup(req.token_ids, self._usable_blocks(req))
        return req.num_tokens - len(blocks) * self.allocator.block_size

    def register(self, req: Request) -> None:
        """Put the request's final full blocks in the prefix cache (no-op without caching),
        and with state snapshots its row's staged state, for the entry of the block ending at
        ``snapshot_at`` once that block is registered (its tokens final: a rejected draft's
        staged state never is)."""
        a = self.allocator
        if not a.caching:
            return
        a.register(req.block_ids, req.block_entries, req.token_ids, req.num_computed_tokens)
        end, req.snapshot_at = req.snapshot_at or 0, None
        blocks = end // a.block_size
        if a.snapshots and 0 < blocks <= len(req.block_entries):  # entries: final blocks
            snapshot = a.snapshot_for(req.block_entries[blocks - 1])
            if snapshot is not None:
                self.state_saves.append((req.row, snapshot))

    def reserve(self, req: Request, num_tokens: int) -> None:
        """KV blocks for ``num_tokens`` more fed tokens, the drafts after them and
        ``reserve_ahead`` (capped at max_model_len)."""
        end = req.num_computed_tokens + num_tokens + self.draft_rows + self.reserve_ahead
        self.allocator.ensure(req.block_ids, min(end, self.max_model_len))

    def abort(self, req: Request, reason: str) -> None:
        """Drop a waiting or running request (its blocks and row freed); no-op once finished."""
        if req.status == Status.WAITING:
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, reason
        elif req.status == Status.RUNNING:
            self.finish(req, reason)

    def finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.running.remove(req)
        if reason != "error":  # a failed step's request: nothing more is trusted
            self.register(req)
        self.allocator.release(req.block_ids)
        self.free_rows.append(req.row)
        if self.on_finish is not None:
            self.on_finish(req)

    def abort_by_id(self, request_id: str, reason: str = "abort") -> Request | None:
        """``abort`` the unfinished request with that id; -> the request, or None when no
        unfinished request has that id."""
        for req in [*self.waiting, *self.running]:
            if req.request_id == request_id:
                self.abort(req, reason)
                return req
        return None
