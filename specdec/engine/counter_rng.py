"""Counter-based random numbers: a pure function of (key, counter, stream, lane), computed with
int64 tensor ops on the device, so a captured step draws fresh numbers every replay with no
generator state and no host input, and a request's numbers do not depend on its batch.

    u(key, counter, stream, lane) = top 53 bits of mix(mix(mix(mix(key) ^ stream) ^ counter) ^ lane)

``mix`` is SplitMix64's finalizer (Steele, Lea, Flood 2014) over a golden-ratio step, in
two's-complement int64 (a logical shift is an arithmetic one masked). The sampler keys a
request by its seed (or the engine seed and request id), counts by the position of the token
it samples, and takes one stream for the acceptance uniforms and one for the exponential race.

Example: ``uniforms(torch.tensor([7]), torch.tensor([3]), stream=1, lanes=2)`` gives the same
two numbers in [0, 1) on every call, device and batch; key 8 gives two others.
"""

import zlib

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as signed int64
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
STREAM_UNIFORM, STREAM_RACE = 1, 2


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def uniforms(keys: torch.Tensor, counters: torch.Tensor, stream: int,
             lanes: int) -> torch.Tensor:
    """keys, counters [B] int64 -> [B, lanes] float64 in [0, 1) (multiples of 2**-53)."""
    # the stream mixed in on its own: added to the key, key k + 1's stream 1 was key k's
    # stream 2 (sample i + 1 of a seeded n > 1 request, seed + i + 1, accepted drafts with
    # the numbers sample i drew its tokens with)
    z = _mix(_mix(_mix(keys.long()) ^ stream) ^ counters.long())
    # xor the lane in, as the counter: inductor's CPU code for ``arange * <64-bit constant>``
    # with a symbolic length wraps wrongly past the first vector (compile_dynamic drew NaN
    # exponentials from it); a lane only ever meets loaded values here
    lane = torch.arange(lanes, dtype=torch.int64, device=keys.device)
    return _shr(_mix(z[:, None] ^ lane), 11).double() * 2.0 ** -53


def exponentials(keys: torch.Tensor, counters: torch.Tensor, stream: int,
                 lanes: int) -> torch.Tensor:
    """[B, lanes] float32 Exp(1) draws, > 0 (``-log(1 - u)``, clamped away from 0)."""
    e = -torch.log1p(-uniforms(keys, counters, stream, lanes))
    return e.float().clamp_min(torch.finfo(torch.float32).tiny)


def request_key(seed: int | None, engine_seed: int, request_id: str) -> int:
    """A request's key: its own seed, else one from the engine seed and its id (the same in
    every process: crc32, not Python's salted hash). A signed int64."""
    if seed is not None:
        return seed
    return (engine_seed * 0x9E3779B1 + zlib.crc32(request_id.encode())) % (1 << 63)
