"""Draft trees (issue 53): a static one (vLLM's ``speculative_token_tree``) as the arrays a
padded tree step runs on, a dynamic one's (EAGLE-2) sizes, a host drafter's (suffix decoding)
bounds, and any tree's node shapes from its parents (``node_shapes``).

vLLM's key lists the tree's paths, each a tuple of child ranks from the root: ``(0,)`` the
root's most likely child, ``(1,)`` its second, ``(0, 0)`` the most likely child of ``(0,)``.
Nodes are numbered root first, then by depth, then by path (parents before children: the
order the tree sampler and the tree attention mask need); node k's ``parent`` is a node
number (-1 for the root), its ``depth`` the path length, its ``rank`` the last child rank
(which of its parent's top-k drafts it is), its ``ancestors`` a bitmask of its path's nodes
and itself (``TreeMask``'s). A chain of K drafts is ``[(0,), (0, 0), (0, 0, 0), ...]``.
The drafter's head runs at the nodes with children only (``heads``, the root first: a leaf's
head output would rank children it has none of); head i's K/V is head row i after the root's,
``head_ancestors`` its path's bitmask over head rows.

Example: paths [(0,), (1,), (0, 0)] -> nodes root, (0,), (1,), (0, 0):
parent [-1, 0, 0, 1], depth [0, 1, 1, 2], rank [0, 0, 1, 0],
ancestors [0b1, 0b11, 0b101, 0b1011]; heads [0, 1] (the root and (0,)), head_ancestors
[0b1, 0b11].
"""

import ast
import math
from dataclasses import dataclass
from typing import NamedTuple

MAX_TREE_NODES = 63  # the root and 62 drafts: an int64 ancestors bitmask


class TreeLevel(NamedTuple):
    """One depth of a ``StaticTree`` as the drafter runs it (``StaticTree.levels``)."""

    nodes: tuple[int, ...]  # this depth's nodes, ascending
    ups: tuple[int, ...]  # their parents, ascending: each ranks its logits once
    width: int  # ranks taken at each parent: 1 + the largest rank here
    picks: tuple[tuple[int, int], ...]  # per node, (its parent's index in ups, its rank)
    heads: tuple[int, ...]  # the nodes with children (none at the deepest depth)
    head_parents: tuple[int, ...]  # their parents
    first_row: int  # head row of heads[0]; the others follow it


@dataclass(frozen=True)
class StaticTree:
    paths: tuple[tuple[int, ...], ...]  # the drafts' paths in node order (node 1 first)
    parent: tuple[int, ...]  # per node, the root first
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    ancestors: tuple[int, ...]
    heads: tuple[int, ...]  # the nodes with children, the root first (module docstring)
    head_ancestors: tuple[int, ...]  # per head, its path's bitmask over head rows

    @classmethod
    def from_paths(cls, paths) -> "StaticTree":
        """``paths``: vLLM's ``speculative_token_tree``, a list of tuples of child ranks or
        its string. ValueError naming the key for a path that is not a tuple of ints >= 0,
        repeats, a missing parent path, or more than MAX_TREE_NODES - 1 drafts."""
        if isinstance(paths, str):
            try:
                paths = ast.literal_eval(paths)
            except (ValueError, SyntaxError):
                raise ValueError(f"speculative_token_tree={paths!r}: not a list of tuples, "
                                 "e.g. '[(0,), (1,), (0, 0)]'") from None
        if not isinstance(paths, (list, tuple)) or not paths:
            raise ValueError(f"speculative_token_tree={paths!r}: give a non-empty list of "
                             "paths, e.g. [(0,), (1,), (0, 0)]")
        seen = set()
        for p in paths:
            if not isinstance(p, (list, tuple)) or not p or any(
                    isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in p):
                raise ValueError(f"speculative_token_tree: path {p!r} is not a non-empty "
                                 "tuple of child ranks (ints >= 0)")
            if tuple(p) in seen:
                raise ValueError(f"speculative_token_tree: path {tuple(p)} given twice")
            seen.add(tuple(p))
        for p in seen:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"speculative_token_tree: path {p} has no parent path "
                                 f"{p[:-1]}")
        if len(seen) > MAX_TREE_NODES - 1:
            raise ValueError(f"speculative_token_tree: {len(seen)} drafts; allowed at most "
                             f"{MAX_TREE_NODES - 1}")
        ordered = sorted(seen, key=lambda p: (len(p), p))
        number = {p: k + 1 for k, p in enumerate(ordered)}
        parent = [-1] + [number.get(p[:-1], 0) for p in ordered]
        depth, ancestors = node_shapes(parent)
        heads = sorted(set(parent[1:]))  # a head's parent is a head
        _, head_ancestors = node_shapes([-1] + [heads.index(parent[k]) for k in heads[1:]])
        return cls(tuple(ordered), tuple(parent), tuple(depth), (0, *(p[-1] for p in ordered)),
                   tuple(ancestors), tuple(heads), tuple(head_ancestors))

    @classmethod
    def chain(cls, k: int) -> "StaticTree":
        return cls.from_paths([(0,) * d for d in range(1, k + 1)])

    @property
    def num_nodes(self) -> int:
        """The root and the drafts: the tokens a request verifies per step."""
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def head_rows(self) -> int:
        """Head K/V rows a step's draft tree writes after the root's (its heads')."""
        return len(self.heads) - 1

    def levels(self) -> tuple[TreeLevel, ...]:
        """Depths 1..max_depth as ``TreeLevel``s. The worked example's: nodes (1, 2), ups
        (0,), width 2, picks ((0, 0), (0, 1)), heads (1,), head_parents (0,), first_row 1;
        then (3,), (1,), 1, ((0, 0),), (), (), 2."""
        levels = []
        for d in range(1, self.max_depth + 1):
            nodes = tuple(k for k in range(self.num_nodes) if self.depth[k] == d)
            ups = tuple(sorted({self.parent[k] for k in nodes}))
            heads = tuple(k for k in nodes if k in self.heads)
            first = self.heads.index(heads[0]) if heads else len(self.heads)
            levels.append(TreeLevel(nodes, ups, 1 + max(self.rank[k] for k in nodes),
                                    tuple((ups.index(self.parent[k]), self.rank[k])
                                          for k in nodes), heads,
                                    tuple(self.parent[k] for k in heads), first))
        return tuple(levels)

    @property
    def label(self) -> str:
        """E.g. "static 6 drafts d3" (a report's row)."""
        return f"static {self.num_nodes - 1} drafts d{self.max_depth}"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's tree (SGLang's ``topk`` / ``num_steps`` / ``num_draft_tokens``), chosen per
    request per step on the device: the root's ``top_k`` most likely children are the first
    frontier; each of ``max_depth - 1`` head forwards ranks the ``top_k`` children of each
    frontier node, scored by cumulative draft log-probability, and the ``top_k`` best of those
    ``top_k**2`` are the next frontier. Of all ``num_candidates`` candidates the
    ``num_nodes - 1`` best scored are the drafts (a child scores at most its parent, so they
    form a tree), in candidate order (by depth: parents first). The head runs its frontier
    nodes only: ``head_rows`` K/V rows after the root's.

    A candidate's log-probability is the head's log-softmax of its logits / the score
    temperature (``tree_temperature.py``: T < 1 makes it the chance that the draft is the
    target's greedy token; None: the head's configured one, else 1), or / the request's
    sampling temperature where that is higher.

    Example: top_k 2, max_depth 3, num_nodes 6 -> candidates 2 + 2 * 4 = 10; head forwards
    over 2 nodes at depths 1 and 2; 5 drafts verified per request."""

    top_k: int
    num_nodes: int  # the root and its drafts: tokens verified per request per step
    max_depth: int
    score_temperature: float | None = None

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.max_depth - 1) * self.top_k ** 2

    @property
    def head_rows(self) -> int:
        return (self.max_depth - 1) * self.top_k

    @property
    def label(self) -> str:
        """E.g. "top-2 5 drafts d3", "top-2 5 drafts d3 T0.3" (a report's row)."""
        t = "" if self.score_temperature is None else f" T{self.score_temperature:g}"
        return f"top-{self.top_k} {self.num_nodes - 1} drafts d{self.max_depth}{t}"


@dataclass(frozen=True)
class HostTree:
    """A tree a host drafter shapes per request per step (suffix decoding: the continuations
    its counts hold, ``suffix.py``): at most ``num_nodes - 1`` drafts, at most ``max_depth``
    deep, each request's parents sent with its drafts. No head, so no head rows."""

    num_nodes: int  # the root and at most num_nodes - 1 drafts verified per request per step
    max_depth: int

    head_rows = 0

    @property
    def label(self) -> str:
        """E.g. "suffix 8 drafts d5" (a report's row)."""
        return f"suffix {self.num_nodes - 1} drafts d{self.max_depth}"


def check_score_temperature(value, source: str) -> float:
    """A dynamic tree's score temperature (``source`` names where it was given): a finite
    number > 0, else ValueError."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{source}={value!r}: allowed a finite number > 0")
    return float(value)


def node_shapes(parents) -> tuple[list[int], list[int]]:
    """(depth, ancestors bitmask) of each node of a tree given its nodes' parents, the root's
    -1 first (parents before children). E.g. [-1, 0, 0, 1] -> [0, 1, 1, 2], [1, 3, 5, 11]."""
    depth, ancestors = [0], [1]
    for k, up in enumerate(parents[1:], start=1):
        depth.append(depth[up] + 1)
        ancestors.append(ancestors[up] | (1 << k))
    return depth, ancestors
