"""The block pool and its prefix cache (``engine/block_allocator.py``) under the real scheduler:
random arrivals, aborts and speculative steps against a simulated KV cache whose every slot
records the tokens it was computed from, checking the pool's invariants after every step."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Request, SamplingParams, Status

BS, K, MAX_LEN = 4, 2, 40


def test_the_worked_example():
    pool = BlockAllocator(8, 2, caching=True)
    blocks, entries = [], []
    pool.ensure(blocks, 5)
    pool.register(blocks, entries, [5, 6, 7, 8, 9], 5)
    assert entries == [0, 1] and pool.cached == {(-1, (5, 6)): (blocks[0], 0),
                                                 (0, (7, 8)): (blocks[1], 1)}
    assert pool.hit([5, 6, 7, 8, 1], 2) == (blocks[:2], [0, 1])
    assert pool.hit([5, 6, 7, 3, 1], 2) == (blocks[:1], [0])
    assert pool.ref[blocks[0]] == 3 and pool.ref[blocks[1]] == 2


def test_lookahead_keys_read_the_token_after_the_block():
    """An EAGLE-style drafter's KV at a block's last position depends on the token after it:
    a prompt that differs only there misses."""
    pool = BlockAllocator(8, 2, caching=True, lookahead=1)
    blocks, entries = [], []
    pool.ensure(blocks, 5)
    pool.register(blocks, entries, [5, 6, 7, 8, 9], 5)
    assert len(entries) == 2  # the second block's key reads token 9
    assert pool.hit([5, 6, 7, 8, 9, 1], 2)[1] == [0, 1]
    assert pool.hit([5, 6, 1, 8, 9, 1], 2)[1] == []


class Token(int):
    """A token id whose hash is the same for every value: every key collides."""

    def __hash__(self):
        return 0


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1,
                max_size=8))
def test_keys_never_collide_even_when_every_hash_does(seqs):
    """With every key's hash equal, a hit is still exactly the longest registered prefix of
    whole blocks (brute force over the registered sequences)."""
    pool = BlockAllocator(64, 2, caching=True)
    registered = []
    for seq in seqs:
        tokens = [Token(t) for t in seq]
        full = len(tokens) // 2
        blocks, entries = pool.hit(tokens, full)
        want = max((n for r in registered for n in range(full + 1)
                    if r[:2 * n] == seq[:2 * n] and len(r) >= 2 * n), default=0)
        assert len(blocks) == want
        pool.ensure(blocks, len(tokens))
        pool.register(blocks, entries, tokens, len(tokens))
        registered.append(seq)
        pool.release(blocks)


def next_token(tokens: list[int]) -> int:
    """The simulated target's greedy token after ``tokens``."""
    return (7 * sum(tokens) + len(tokens)) % 3


class Simulation:
    """The scheduler and pool driven by a simulated step: drafts are random and accepted while
    they match ``next_token``; the step writes each kept position's slot with the tokens its
    KV reads (the prefix through the position, plus ``lookahead`` tokens: a head's KV reads
    the next token), and junk at rejected drafts and where the draft loop runs."""

    def __init__(self, lookahead: int, rng: random.Random, num_blocks: int,
                 snapshots: int = 0, pack_prefill: bool = True):
        self.pool = BlockAllocator(num_blocks, BS, caching=True, lookahead=lookahead,
                                   snapshots=snapshots)
        self.sched = Scheduler(2, 10, MAX_LEN, self.pool, num_speculative_tokens=K,
                               reserve_ahead=1 + K, pack_prefill=pack_prefill)
        self.kv = {}  # slot -> the tokens its KV was computed from, or "junk"
        self.entries = {}  # entry id -> key, every one ever registered
        # linear attention: each row's staged state and each snapshot, as the tokens it has
        # consumed (or "junk"), and each row's state to start its next step from
        self.staged, self.snapshot, self.state = {}, {}, {}
        self.rng, self.la, self.n, self.prompts = rng, lookahead, 0, []

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.n += 1
        self.prompts.append(prompt)
        self.sched.add(Request(str(self.n), list(prompt), len(prompt),
                               SamplingParams(max_tokens=max_tokens)))

    def slot(self, r: Request, pos: int) -> int:
        return r.block_ids[pos // BS] * BS + pos % BS

    def step(self) -> None:
        waiting = {r.request_id for r in self.sched.waiting}
        scheduled = self.sched.schedule()
        if not self.sched.pack_prefill:  # a step that ends a prompt stops short of none
            chunks = [s.is_discarded for s in scheduled if s.request.is_prefilling]
            assert all(chunks) or not any(chunks)
        saves, restores = self.sched.take_state_copies()
        for row, snapshot in saves:
            self.snapshot[snapshot] = self.staged[row]
        for snapshot, row in restores:
            self.state[row] = self.snapshot[snapshot]
        for s in scheduled:
            r = s.request
            if r.request_id in waiting:  # admitted: what it hit is its own prefix's KV
                assert r.num_computed_tokens == r.num_cached_tokens < r.num_tokens
                for pos in range(r.num_cached_tokens):
                    assert self.kv[self.slot(r, pos)] == tuple(r.token_ids[:pos + 1 + self.la])
                if self.pool.snapshots and r.num_cached_tokens:  # and its state the prefix's
                    assert self.state[r.row] == tuple(r.token_ids[:r.num_cached_tokens])
            self.run(s)
        self.check()

    def run(self, s) -> None:
        r, start, d = s.request, s.request.num_computed_tokens, len(s.spec_token_ids)
        end = start + s.num_tokens
        # the engine's part: the step stages the state after the last block boundary it
        # crosses (fed tokens, drafts included: what a rejected draft makes of it is junk)
        boundary = end // BS * BS
        fed = r.token_ids[:start + 1] + list(s.spec_token_ids) if d else r.token_ids[:end]
        if boundary > start:
            self.staged[r.row] = tuple(fed[:boundary])
        r.snapshot_at = boundary if boundary > start and self.pool.snapshots else None
        if s.is_discarded:
            r.num_computed_tokens = end
        else:
            accepted = 0
            for draft in s.spec_token_ids:
                if draft != next_token(r.token_ids):
                    break
                r.token_ids.append(draft)
                accepted += 1
            r.token_ids.append(next_token(r.token_ids))  # the sampled token
            r.num_computed_tokens = end - d + accepted
        for pos in range(start, min(end + K, len(r.block_ids) * BS)):
            # kept positions read the request's tokens (a head: the one after too); rejected
            # drafts and the draft loop write junk
            self.kv[self.slot(r, pos)] = (tuple(r.token_ids[:pos + 1 + self.la])
                                          if pos < r.num_computed_tokens else "junk")
        if s.is_discarded:
            return
        if len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= MAX_LEN - K - 2:
            self.sched.finish(r, "length")
        else:
            r.spec_token_ids = [self.rng.choice([next_token(r.token_ids), 0, 1])
                                for _ in range(K)]

    def check(self) -> None:
        """refs = holders among running requests; free + held = all; a cached block's slots
        hold the tokens its key chain names."""
        pool, held = self.pool, {}
        for r in self.sched.running:
            assert len(set(r.block_ids)) == len(r.block_ids)
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        assert all(pool.ref[b] == held.get(b, 0) for b in range(pool.num_blocks))
        assert set(pool.free) == {b for b in range(pool.num_blocks) if b not in held}
        assert len(pool.free) + len(held) == pool.num_blocks
        for key, (block, entry) in pool.cached.items():
            assert pool.key_of[block] == key
            self.entries[entry] = key
        for key, (block, _) in pool.cached.items():
            tokens = self.prefix(key)
            start = len(tokens) - BS - self.la
            for j in range(BS):
                assert self.kv[block * BS + j] == tuple(tokens[:start + j + 1 + self.la])
        # snapshots: each held by one live entry, holding (once the saves due before the
        # next step have run) the state after its block
        live = {entry: key for key, (_, entry) in pool.cached.items()}
        assert set(pool.snapshot_of) <= set(live)
        assert sorted([*pool.snapshot_of.values(), *pool.free_snapshots]) == list(
            range(pool.snapshots))
        due = {snapshot: self.staged[row] for row, snapshot in self.sched.state_saves}
        for entry, snapshot in pool.snapshot_of.items():
            tokens = self.prefix(live[entry])
            assert due.get(snapshot, self.snapshot.get(snapshot)) == tuple(
                tokens[:len(tokens) - self.la])

    def prefix(self, key) -> list[int]:
        """Every token a key chain names (its last block's lookahead included)."""
        parent, tokens = key
        if parent == -1:
            return list(tokens)
        return self.prefix(self.entries[parent])[:-self.la or None] + list(tokens)


# prompts share prefixes: a cut of one of three bases, then a few tokens of their own
BASES = [[i % 3 for i in range(18)], [1] * 18, [0, 1] * 9]
PROMPTS = st.builds(lambda base, cut, tail: BASES[base][:cut] + tail, st.integers(0, 2),
                    st.integers(0, 18), st.lists(st.integers(0, 2), min_size=1, max_size=4))
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), PROMPTS, st.integers(1, 6)),
    st.tuples(st.just("again"), st.integers(1, 12)),  # an earlier request's prompt again
    st.tuples(st.just("abort"), st.integers(1, 12)),
    st.tuples(st.just("step"))), max_size=40)


@pytest.mark.parametrize("snapshots", [0, 2], ids=["attention", "linear-attention"])
@pytest.mark.parametrize("lookahead", [0, 1])
@given(ops=OPS, seed=st.integers(0, 2**16), pack=st.booleans())
def test_random_arrivals_and_aborts_keep_the_pool_consistent(lookahead, snapshots, ops, seed,
                                                             pack):
    """The pool's invariants after every step and abort; with state snapshots (a target with
    linear attention, 2 snapshot slots) also: a hit's restored state is its prefix's, and
    every snapshot holds the state after its entry's block (a step staging the state after
    the last boundary its tokens cross, drafts included: only an accepted one is kept).
    Prefill chunks packed into the budget or not (``pack_prefill``): unpacked, a step with a
    chunk that ends its prompt holds none that stops short, and every request still ends."""
    sim = Simulation(lookahead, random.Random(seed), num_blocks=2 * (MAX_LEN // BS),
                     snapshots=snapshots, pack_prefill=pack)
    for op in ops:
        if op[0] == "add":
            sim.add(op[1], op[2])
        elif op[0] == "again" and op[1] <= sim.n:
            sim.add(sim.prompts[op[1] - 1], 3)
        elif op[0] == "abort":
            sim.sched.abort_by_id(str(op[1]))
            sim.check()
        else:
            sim.step()
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.pool.ref == [0] * sim.pool.num_blocks
    assert len(sim.pool.free) == sim.pool.num_blocks
    for r in range(1, sim.n + 1):
        assert sim.sched.abort_by_id(str(r)) is None  # every one finished
