"""A request's chunks as its HTTP handler reads them (``RequestHandle.next_chunk``): a reader
that lags the engine gets the steps queued meanwhile merged, and nothing is lost or reordered."""

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.async_engine import RequestHandle, TokenChunk

STEP = st.lists(st.integers(0, 99), min_size=1, max_size=4)  # one engine step's tokens


@st.composite
def streams(draw):
    """A request's chunks as the engine sends them (token steps, then one that ends it: a
    finish reason or an error; an error may come before the end too, as an engine failure
    does), and after each chunk whether the reader reads before the next one arrives."""
    chunks = [TokenChunk(t) for t in draw(st.lists(STEP, max_size=8))]
    end = draw(st.sampled_from(["length", "eos", "abort", "error"]))
    if end == "error":
        chunks.append(TokenChunk([], error="engine error: boom"))
    else:
        chunks.append(TokenChunk(draw(STEP), end))
    return chunks, draw(st.lists(st.booleans(), min_size=len(chunks), max_size=len(chunks)))


async def read(chunks, read_after) -> list[TokenChunk]:
    """Put the chunks in a handle's queue, reading whenever ``read_after`` says, then read on
    to the end (a chunk that ends the request or an error) -> what the reader got."""
    handle, got = RequestHandle("req-0", [1], SamplingParams()), []

    async def read_one():
        got.append(await handle.next_chunk())

    for chunk, now in zip(chunks, read_after):
        handle.chunks.put_nowait(chunk)
        if now:
            await read_one()
    while not got or (got[-1].finish_reason is None and got[-1].error is None):
        await read_one()
    return got


@given(streams())
def test_a_lagging_reader_gets_every_token_once_in_order(stream):
    """Merged or not, the reads carry the engine's tokens in order, end as the stream ends,
    and an error comes alone, after every token before it; a read merges exactly the chunks
    that were queued at that moment."""
    chunks, read_after = stream
    got = asyncio.run(read(chunks, read_after))
    assert [t for c in got for t in c.token_ids] == [t for c in chunks for t in c.token_ids]
    assert (got[-1].finish_reason, got[-1].error) == (chunks[-1].finish_reason,
                                                      chunks[-1].error)
    assert all(c.finish_reason is None and c.error is None for c in got[:-1])
    if chunks[-1].error is not None:
        assert got[-1].token_ids == []
    # reads: one per run of chunks queued between two reads (an error splits its run)
    runs, queued = 0, 0
    for chunk, now in zip(chunks, read_after):
        runs += chunk.error is not None and queued > 0
        queued += 1
        if now:
            runs, queued = runs + 1, 0
    assert len(got) == runs + (queued > 0)


def test_a_reader_that_keeps_up_gets_one_chunk_per_step():
    chunks = [TokenChunk([1, 2]), TokenChunk([3]), TokenChunk([4], "length")]
    assert asyncio.run(read(chunks, [True] * 3)) == chunks
