"""Argument checks shared by every public entry point.

Each raises ``TypeError`` (wrong type) or ``ValueError`` (right type, value not allowed), and
the message names the field, the value and what is allowed, e.g.
``check_int("seed", "abc")`` -> ``TypeError: seed='abc': must be an int``.
"""

import math


def check_int(name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """An int (never a bool) in ``[lo, hi]`` (either bound optional)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be an int")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "" if lo is None else f"{lo} <= "
        hi_s = "" if hi is None else f" <= {hi}"
        raise ValueError(f"{name}={value!r}: allowed {lo_s}{name}{hi_s}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be a bool (True or False)")
    return value


def check_float(name: str, value, *, lo: float, hi: float = math.inf,
                lo_open: bool = False) -> float:
    """A finite real number (int or float, never a bool or a str) in ``[lo, hi]``
    (``(lo, hi]`` with ``lo_open``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be a float")
    value = float(value)
    too_low = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or too_low or value > hi:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name}={value!r}: must be finite, in {bracket}{lo}, {hi}]")
    return value


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """A list/tuple of ints in ``[0, vocab_size)``; returns them as a list."""
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{name}={ids!r}: must be a str or a list of int token ids")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"{name}[{i}]={t!r}: token ids must be ints")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}]={t}: token ids must be in [0, vocab_size="
                             f"{vocab_size})")
    return list(ids)
