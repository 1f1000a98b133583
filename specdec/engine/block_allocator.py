"""KV block ids for requests (one block table shared by the target and the draft head), and the
prefix cache over them.

Blocks are reference-counted: a block is *held* (ref >= 1: that many running requests have it
in their block table) or *free* (ref 0). ``free`` keeps the free blocks least recently used
first; a new block is the first of them, so a cached block is evicted only when no never-cached
block is left before it.

Prefix caching (``caching``): a request's full block ``i`` whose every position is final
(``< num_computed_tokens``: nothing writes there again, drafts and padding land at later
positions) is registered under the key ``(parent, tokens)``: ``parent`` is the entry id of
block ``i - 1`` in the chain (-1 for the first block), ``tokens`` the tuple of the block's
``block_size`` token ids and the ``lookahead`` ids after it. Entry ids are never reused, so a key
stands for exactly one token prefix: two different prefixes cannot share a key (keys are
compared as tuples, never through a hash alone). ``lookahead`` = 1 for a drafter whose KV at
position p is computed from token p + 1 (an EAGLE / EAGLE-3 / MTP head reads the target's hidden
state at p with token p + 1), so a hit reuses the head's KV exactly as a recomputation would
write it; 0 otherwise. A cached block stays cached while free, until it is evicted.

Worked example (block_size 2, lookahead 0): a request with tokens [5, 6, 7, 8, 9] and 5 final
positions registers (-1, (5, 6)) -> entry 0 and (0, (7, 8)) -> entry 1; a prompt [5, 6, 7, 8,
1] then hits both blocks (4 tokens), [5, 6, 7, 3, 1] hits the first only.

A target with linear-attention layers (``snapshots`` > 0) cannot rebuild its recurrent state
from K/V blocks: an entry is usable only with a *snapshot* of that state after its last token
(``linear_state.StateCache.save``), and a hit ends at the deepest entry that has one. Entries
get snapshots (``snapshot_for``) from the ``snapshots`` slots, least recently used first when
none is free; an evicted entry frees its snapshot.
"""

import itertools
from collections import OrderedDict

Key = tuple[int, tuple[int, ...]]  # (parent entry id, token ids)


class BlockAllocator:
    """Hands out KV block ids; every model (target and draft) shares one block table."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = False,
                 lookahead: int = 0, snapshots: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.lookahead = lookahead
        self.snapshots = snapshots  # > 0: hits need a state snapshot (linear attention)
        self.snapshot_of: OrderedDict[int, int] = OrderedDict()  # entry -> snapshot, LRU first
        self.free_snapshots = list(range(snapshots - 1, -1, -1))
        self.ref = [0] * num_blocks  # running requests holding each block
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[Key, tuple[int, int]] = {}  # key -> (block, entry id)
        self.key_of: dict[int, Key] = {}  # cached block -> its key
        self._entry_ids = itertools.count()

    def ensure(self, block_ids: list[int], num_positions: int) -> None:
        """Grow ``block_ids`` in place to cover positions ``[0, num_positions)``."""
        needed = -(-num_positions // self.block_size) - len(block_ids)
        if needed > len(self.free):
            raise RuntimeError(
                f"out of KV blocks: need {needed}, {len(self.free)} free; raise num_kv_blocks"
            )
        for _ in range(max(needed, 0)):
            block, _ = self.free.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None:  # evicted: its entry goes, and its snapshot
                snapshot = self.snapshot_of.pop(self.cached.pop(key)[1], None)
                if snapshot is not None:
                    self.free_snapshots.append(snapshot)
            self.ref[block] = 1
            block_ids.append(block)

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block; a block no one holds is free, its last block first in
        line for eviction (the prefix is the part most likely to be hit again)."""
        for block in reversed(block_ids):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        block_ids.clear()

    def hit(self, token_ids: list[int], num_blocks: int) -> tuple[list[int], list[int]]:
        """``lookup``'s blocks, each given one more hold. -> (block ids, entry ids)."""
        blocks, entries = self.lookup(token_ids, num_blocks)
        if entries and self.snapshots:
            self.snapshot_of.move_to_end(entries[-1])
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
        return blocks, entries

    def lookup(self, token_ids: list[int], num_blocks: int) -> tuple[list[int], list[int]]:
        """The cached blocks of the longest chain of ``token_ids``' first ``num_blocks`` full
        blocks (each block's key reads its ``lookahead`` tokens after it: the caller bounds
        ``num_blocks`` so that they exist), nothing held. With ``snapshots``, the chain ends
        at its deepest entry that has a snapshot (``snapshot_of[entries[-1]]``).
        -> (block ids, entry ids)."""
        blocks, entries, parent, bs = [], [], -1, self.block_size
        for i in range(num_blocks):
            found = self.cached.get((parent, tuple(token_ids[i * bs:(i + 1) * bs
                                                             + self.lookahead])))
            if found is None:
                break
            block, parent = found
            blocks.append(block)
            entries.append(parent)
        if self.snapshots:  # the state is known only where a snapshot was kept
            while entries and entries[-1] not in self.snapshot_of:
                blocks.pop()
                entries.pop()
        return blocks, entries

    def register(self, block_ids: list[int], entries: list[int], token_ids: list[int],
                 num_final: int) -> None:
        """Register a request's full blocks whose ``num_final`` first positions are final
        (and whose lookahead tokens are known), past the ``entries`` it already has (its chain
        of entry ids, grown in place). A block whose key is cached already (another request
        computed the same prefix) is left unregistered; the chain goes on through that
        entry."""
        bs, la = self.block_size, self.lookahead
        full = min(num_final, len(token_ids) - la, len(block_ids) * bs) // bs
        for i in range(len(entries), full):
            key = (entries[-1] if entries else -1,
                   tuple(token_ids[i * bs:(i + 1) * bs + la]))
            found = self.cached.get(key)
            if found is None:
                found = self.cached[key] = (block_ids[i], next(self._entry_ids))
                self.key_of[block_ids[i]] = key
            entries.append(found[1])

    def snapshot_for(self, entry: int) -> int | None:
        """A snapshot slot for ``entry``'s state (the least recently used one when none is
        free, its entry losing it); None when the entry has one already."""
        if entry in self.snapshot_of:
            return None
        if self.free_snapshots:
            snapshot = self.free_snapshots.pop()
        else:
            _, snapshot = self.snapshot_of.popitem(last=False)
        self.snapshot_of[entry] = snapshot
        return snapshot

    def drop_snapshots(self, snapshots: list[int]) -> None:
        """Free these snapshots, their entries losing them: copies into them that may not
        have run (a step that failed while copying)."""
        lost = set(snapshots)
        for entry in [e for e, s in self.snapshot_of.items() if s in lost]:
            self.free_snapshots.append(self.snapshot_of.pop(entry))
