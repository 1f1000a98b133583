"""Suffix decoding: drafts from a suffix tree over the request's own tokens and one over the
outputs of recent finished requests (vLLM's ``method: "suffix"`` keys; ArcticInference's
rule).

Each tree counts, for every string of up to ``max_tree_depth`` tokens, its occurrences in
the sequences it holds (``SuffixTree``: a trie of every suffix cut at that depth, counts on
the nodes). A proposal, for each match length m = 1, 2, ... (the request's last m tokens; it
stops at the first m the tree does not hold, or, in the request's own tree, holds only as
the request's end), walks from the matched node to its most frequent child (ties: the
smaller token id) while the product of child / parent counts stays >= ``min_token_prob``,
at most ``min(K, floor(m * max_spec_factor))`` tokens. Its score is the sum of those
products; the best score over m wins (ties: the longer match), then the better of the two
trees (ties: the request's own). Example (own tree, tokens [1, 2, 3, 1, 2], K = 2, factor 1):
m = 1 matches [2] -> [3] (1/2: [2] occurs twice, once followed by 3); m = 2 matches [1, 2]
-> [3, 1] (1/2, 1/2) with score 1.0, the best.

With ``num_draft_tokens`` (a ``HostTree``) a proposal is a tree instead of a path
(SuffixDecoding's tree speculation): from the matched node, best first, the candidate whose
product of child / parent counts along its path is highest (ties: the one found first; a
node's children are found most frequent first, then smaller token first) becomes the next
draft while that product is
>= ``min_token_prob``, at most ``min(num_draft_tokens - 1, floor(m * max_spec_factor))``
drafts, at most ``num_speculative_tokens`` deep; the score is again the sum of the products.
Drafts come in the order taken, so parents come before children. Example (own tree, tokens
[1, 2, 3, 1, 2, 4, 1, 2], 3 drafts, factor 2, depth 2): m = 2 matches [1, 2] three times
(the request's end among them), followed once by 3 and once by 4 (1/3 each): drafts 3 and 4
(the root's children), then 3's child 1 (1/3 x 1/1) -> tokens [3, 4, 1], parents [0, 0, 1],
score 1.0 (m = 1 holds the same ends but allows 2 drafts: score 2/3).

The request's own "tree" is not built as a trie: a prompt of n tokens would cost n x depth
node updates in the step that ends its prefill (about 10 ms for 800 tokens on a CPU, on
every request's time to first token). ``TokenIndex`` keeps the positions of each token
instead (n appends) and ``index_drafts`` counts the same strings by narrowing the positions
that match, with the same rule and the same drafts.
"""

import heapq
import itertools
from collections.abc import Callable

from specdec.config import SpeculativeConfig
from specdec.proposers.base import HostProposer


class SuffixTree:
    """Counts of every string of up to ``depth`` tokens in the sequences added, as a trie of
    node ids: ``counts[node]`` (occurrences of the node's string) and ``children[node]``
    ({token: child node}); node 0 is the root (the empty string). ``extend`` appends tokens to
    one sequence (its open suffixes grow by one token each); ``remove`` takes a whole sequence
    out again. Only ints are stored, so the garbage collector tracks none of the nodes (one
    Python object per node made every full collection walk the whole trie: 115-131 ms
    pauses in the middle of a serving step)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.counts = [0]
        self.children: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._open: dict[object, list[int]] = {}  # sequence key -> nodes of its open suffixes

    def _new_node(self) -> int:
        """A node with count 0 and no children (a freed one first)."""
        if self._free:
            return self._free.pop()
        self.counts.append(0)
        self.children.append({})
        return len(self.counts) - 1

    def _walk(self, node: int, tokens: list[int]) -> int:
        """Count one more occurrence of each string ``node``'s string + ``tokens[:j]`` (j = 1
        .. len(tokens)), making the nodes missing -> the last one's node."""
        counts, children = self.counts, self.children
        for t in tokens:
            below = children[node]
            child = below.get(t)
            if child is None:
                child = below[t] = self._new_node()
            counts[child] += 1
            node = child
        return node

    def extend(self, key, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new key starts a sequence).

        The sequence's open suffixes (the nodes of its last 1 .. depth - 1 tokens, longest
        first) each walk on by the new tokens until they reach the depth, then each new
        token starts a suffix of its own that walks to the depth or the end: one walk per
        start position, each string counted once, as the trie's definition counts them."""
        open_nodes = self._open.setdefault(key, [])
        depth, n = self.depth, len(tokens)
        still_open = []
        for i, node in enumerate(open_nodes):
            length = len(open_nodes) - i  # longest first: lengths len(open_nodes) .. 1
            node = self._walk(node, tokens[:depth - length])
            if length + n < depth:  # it took every new token and is still short
                still_open.append(node)
        for s in range(n):
            node = self._walk(0, tokens[s:s + depth])
            if n - s < depth:
                still_open.append(node)
        open_nodes[:] = still_open

    def close(self, key) -> None:
        """Sequence ``key`` gets no more tokens (its counts stay)."""
        self._open.pop(key, None)

    def remove(self, tokens: list[int]) -> None:
        """Take a whole sequence added earlier out of the counts (nodes left at 0 go, with
        the nodes below them)."""
        for start in range(len(tokens)):
            node = 0
            for t in tokens[start:start + self.depth]:
                child = self.children[node][t]
                self.counts[child] -= 1
                if self.counts[child] == 0:
                    del self.children[node][t]
                    self._release(child)
                    break
                node = child

    def _release(self, node: int) -> None:
        """Free ``node`` and every node below it."""
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children[n].values())
            self.children[n] = {}
            self.counts[n] = 0
            self._free.append(n)

    def find(self, tokens: list[int]) -> int | None:
        """The node of the string ``tokens`` (at most ``depth`` long), or None."""
        node = 0
        for t in tokens:
            node = self.children[node].get(t)
            if node is None:
                return None
        return node


def match_nodes(tree: SuffixTree, tokens: list[int]):
    """Per match length m = 1, 2, ... <= the tree's depth while the last m of ``tokens`` are
    a string of ``tree``: (m, its node)."""
    for m in range(1, min(tree.depth, len(tokens)) + 1):
        node = tree.find(tokens[len(tokens) - m:])
        if node is None:
            return
        yield m, node


def best_path(tree: SuffixTree, node: int, limit: int, min_prob: float
              ) -> tuple[float, list[int]]:
    """From ``node``, follow the most frequent child (ties: the smaller token) while the
    running product of child / parent counts stays >= ``min_prob``, at most ``limit`` tokens
    -> (sum of the products, tokens)."""
    counts, children = tree.counts, tree.children
    prob, score, out = 1.0, 0.0, []
    while len(out) < limit and children[node]:
        token, child = max(children[node].items(), key=lambda kv: (counts[kv[1]], -kv[0]))
        prob *= counts[child] / counts[node]
        if prob < min_prob:
            break
        score += prob
        out.append(token)
        node = child
    return score, out


def tree_drafts(tree: SuffixTree, tokens: list[int], k: int, factor: float,
                min_prob: float) -> tuple[float, list[int]]:
    """The best (score, drafts) over the match lengths of ``tokens``' suffix in ``tree`` (a
    tree of other sequences)."""
    best = (0.0, [])
    for m, node in match_nodes(tree, tokens):
        found = best_path(tree, node, min(k, int(m * factor)), min_prob)
        if found[1] and found[0] >= best[0]:
            best = found
    return best


def grow_tree(children: Callable, root, root_count: int, limit: int, depth: int,
              min_prob: float) -> tuple[float, list[int], list[int]]:
    """The module docstring's tree from a matched node: ``children(node)`` -> [(token, count,
    child)] (a child's count: the occurrences of its string), ``root_count`` the matched
    string's; at most ``limit`` drafts, ``depth`` deep -> (score, tokens, parents: node
    numbers, 0 the root, draft i node i + 1)."""
    heap, found = [], itertools.count()

    def offer(node, count: int, prob: float, parent: int, level: int) -> None:
        if level < depth:
            for token, c, child in sorted(children(node), key=lambda t: (-t[1], t[0])):
                p = prob * c / count
                if p >= min_prob:
                    heapq.heappush(heap, (-p, next(found), token, child, c, parent, level + 1))

    offer(root, root_count, 1.0, 0, 0)
    score, tokens, parents = 0.0, [], []
    while heap and len(tokens) < limit:
        neg, _, token, child, count, parent, level = heapq.heappop(heap)
        score -= neg
        tokens.append(token)
        parents.append(parent)
        offer(child, count, -neg, len(tokens), level)
    return score, tokens, parents


def tree_draft_tree(tree: SuffixTree, tokens: list[int], n: int, max_depth: int,
                    factor: float, min_prob: float) -> tuple[float, list[int], list[int]]:
    """``tree_drafts`` as a tree of at most ``n`` drafts, ``max_depth`` deep (``grow_tree``)
    -> (score, tokens, parents)."""
    counts, children = tree.counts, tree.children

    def below(node: int) -> list[tuple[int, int, int]]:
        return [(t, counts[c], c) for t, c in children[node].items()]

    best = (0.0, [], [])
    for m, node in match_nodes(tree, tokens):
        found = grow_tree(below, node, counts[node], min(n, int(m * factor)),
                          min(max_depth, tree.depth - m), min_prob)
        if found[1] and found[0] >= best[0]:
            best = found
    return best


class TokenIndex:
    """One sequence's tokens and, per token id, the positions where it occurs (ascending):
    what ``index_drafts`` counts strings of the sequence from."""

    def __init__(self):
        self.tokens: list[int] = []
        self.at: dict[int, list[int]] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Take the sequence's tokens past the ones held (``token_ids``: all of them)."""
        for p in range(len(self.tokens), len(token_ids)):
            t = token_ids[p]
            self.tokens.append(t)
            self.at.setdefault(t, []).append(p)


def match_ends(index: TokenIndex, depth: int):
    """Per match length m = 1, 2, ... <= ``depth`` while the sequence's last m tokens occur
    once more: (m, the positions where their occurrences end, its own end among them)."""
    seq = index.tokens
    n = len(seq)
    ends = index.at.get(seq[-1], []) if n else []
    for m in range(1, min(depth, n) + 1):
        if m > 1:
            want = seq[n - m]
            ends = [p for p in ends if p >= m - 1 and seq[p - m + 1] == want]
        if len(ends) < 2:
            return
        yield m, ends


def index_drafts(index: TokenIndex, depth: int, k: int, factor: float,
                 min_prob: float) -> tuple[float, list[int]]:
    """``tree_drafts`` of a sequence in its own tree (a trie of ``depth`` over it), from the
    positions instead: the ends of the matches of its last m tokens (its own end among them,
    so a match must occur once more) narrow as m grows; from them the path takes the most
    frequent next token (ties: the smaller) while the running product of (matches followed
    by it) / (matches) stays >= ``min_prob``, the string at most ``depth`` long."""
    seq = index.tokens
    n = len(seq)
    best = (0.0, [])
    for m, ends in match_ends(index, depth):
        limit = min(k, int(m * factor), depth - m)
        cur, prob, score, out = ends, 1.0, 0.0, []
        while len(out) < limit:
            nexts: dict[int, int] = {}
            for p in cur:
                if p + 1 < n:
                    nexts[seq[p + 1]] = nexts.get(seq[p + 1], 0) + 1
            if not nexts:
                break
            token, c = max(nexts.items(), key=lambda kv: (kv[1], -kv[0]))
            prob *= c / len(cur)
            if prob < min_prob:
                break
            score += prob
            out.append(token)
            cur = [p + 1 for p in cur if p + 1 < n and seq[p + 1] == token]
        if out and score >= best[0]:
            best = (score, out)
    return best


def index_draft_tree(index: TokenIndex, depth: int, n: int, max_depth: int, factor: float,
                     min_prob: float) -> tuple[float, list[int], list[int]]:
    """``index_drafts`` as a tree of at most ``n`` drafts, ``max_depth`` deep (``grow_tree``
    over the match ends: a node is the list of positions where its string ends) -> (score,
    tokens, parents)."""
    seq = index.tokens
    size = len(seq)

    def below(ends: list[int]) -> list[tuple[int, int, list[int]]]:
        groups: dict[int, list[int]] = {}
        for p in ends:
            if p + 1 < size:
                groups.setdefault(seq[p + 1], []).append(p + 1)
        return [(t, len(g), g) for t, g in groups.items()]

    best = (0.0, [], [])
    for m, ends in match_ends(index, depth):
        found = grow_tree(below, ends, len(ends), min(n, int(m * factor)),
                          min(max_depth, depth - m), min_prob)
        if found[1] and found[0] >= best[0]:
            best = found
    return best


class SuffixProposer(HostProposer):
    """Drafts by suffix decoding (above), on the host, after each step; keeps each running
    request's own index and one tree over the outputs of the last ``max_cached_requests``
    finished ones."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int):
        super().__init__(config, max_model_len=max_model_len)
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.own: dict[str, TokenIndex] = {}  # running request id -> its tokens' index
        self.cached = SuffixTree(self.depth)
        self.cached_order: list[list[int]] = []  # finished sequences in the cached tree
        self.tree = config.tree  # a HostTree: drafts trees (num_draft_tokens); None: paths

    def drafts(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """The next step's drafts of a running request with these tokens (at most ``k`` <=
        K, none past max_model_len), a tree's then their parents (node numbers, 0 the
        root). ``k`` 0: nothing at all; its index takes the tokens since its last proposal at
        the next one (a request that ends first never builds it)."""
        limit = self.num_speculative_tokens if self.tree is None else self.tree.num_nodes - 1
        k = min(k, limit, self.max_model_len - len(token_ids))
        if k <= 0:
            return []
        index = self.own.setdefault(request_id, TokenIndex())
        index.extend(token_ids)  # the tokens since its last proposal
        if self.tree is None:
            own = index_drafts(index, self.depth, k, self.factor, self.min_prob)
            other = tree_drafts(self.cached, token_ids, k, self.factor, self.min_prob)
            return (other if other[0] > own[0] else own)[1]
        d = self.tree.max_depth
        own = index_draft_tree(index, self.depth, k, d, self.factor, self.min_prob)
        other = tree_draft_tree(self.cached, token_ids, k, d, self.factor, self.min_prob)
        best = other if other[0] > own[0] else own
        return best[1] + best[2]

    def on_finish(self, request, keep: bool = True) -> None:
        """A request ended: drop its own index; cache its output (its response: the prompt is
        not cached, as vLLM's global tree holds responses only) unless not ``keep`` (an
        engine's warm-up requests), the oldest out past ``max_cached_requests``."""
        self.own.pop(request.request_id, None)
        if self.max_cached == 0 or not keep:
            return
        output = request.output_token_ids
        self.cached.extend(request.request_id, output)
        self.cached.close(request.request_id)
        self.cached_order.append(output)
        if len(self.cached_order) > self.max_cached:
            self.cached.remove(self.cached_order.pop(0))
