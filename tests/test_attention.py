import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from specdec.attention import AttentionMetadata, KVCache, KVCacheSpec
from specdec.engine.block_allocator import BlockAllocator

BS = 4


def _dense_causal(q, k, v, window=None):
    """q [T, Hq, D], k/v [T, Hkv, D] for one sequence -> [T, Hq, D]; ``window`` W: query i
    sees keys i - W < j <= i."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    pos = torch.arange(q.shape[0])
    lag = pos[:, None] - pos[None]
    mask = (lag >= 0) & (lag < (window or q.shape[0]))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)
    return out.transpose(0, 1)


@settings(deadline=None, max_examples=30)
@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=4), chunk=st.integers(1, 9),
       window=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_chunked_paged_attention_equals_dense_causal(lens, chunk, window, seed):
    """Feeding each sequence in chunks through the paged cache equals one dense causal pass,
    for a full layer and a sliding-window one attended in the same forward (they share the
    forward's plan, not its mask)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, 2, 8
    seqs = [(torch.randn(n, hq, d, generator=g, dtype=torch.float64),
             torch.randn(n, hkv, d, generator=g, dtype=torch.float64),
             torch.randn(n, hkv, d, generator=g, dtype=torch.float64)) for n in lens]
    alloc = BlockAllocator(num_blocks=64, block_size=BS)
    cache = KVCache([KVCacheSpec(hkv, d), KVCacheSpec(hkv, d, sliding_window=window)], 64, BS,
                    torch.float64, "cpu")
    blocks = [[] for _ in lens]
    for b, n in zip(blocks, lens):
        alloc.ensure(b, n)
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
    done = [0] * len(lens)
    outs = [[[] for _ in lens] for _ in range(2)]  # per layer
    while any(done[i] < lens[i] for i in range(len(lens))):
        rows = [i for i in range(len(lens)) if done[i] < lens[i]]
        take = [min(chunk, lens[i] - done[i]) for i in rows]
        qs, ks, vs, slots, qsl, seq_lens = [], [], [], [], [0], []
        for i, t in zip(rows, take):
            q, k, v = seqs[i]
            qs.append(q[done[i]:done[i] + t]); ks.append(k[done[i]:done[i] + t])
            vs.append(v[done[i]:done[i] + t])
            for p in range(done[i], done[i] + t):
                slots.append(blocks[i][p // BS] * BS + p % BS)
            qsl.append(qsl[-1] + t)
            seq_lens.append(done[i] + t)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table[rows],
            max_seq_len=max(seq_lens))
        kv = cache.bind(meta)
        for layer in range(2):
            out = kv.attend(layer, torch.cat(qs), torch.cat(ks), torch.cat(vs))
            for j, i in enumerate(rows):
                outs[layer][i].append(out[qsl[j]:qsl[j + 1]])
        for i, t in zip(rows, take):
            done[i] += t
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(torch.cat(outs[0][i]), _dense_causal(q, k, v))
        torch.testing.assert_close(torch.cat(outs[1][i]), _dense_causal(q, k, v, window))


def test_negative_slots_are_not_written():
    cache = KVCache([KVCacheSpec(1, 2)], 2, BS, torch.float32, "cpu")
    before = cache.k[0].clone()
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([-1, -1]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([1, 1], dtype=torch.int32),
        block_table=torch.zeros(2, 1, dtype=torch.int32), max_seq_len=1)
    cache.bind(meta).attend(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    assert torch.equal(cache.k[0][:-1], before[:-1])  # only the trash slot changed


def test_allocator_errors_when_out_of_blocks():
    alloc = BlockAllocator(num_blocks=2, block_size=BS)
    blocks = []
    alloc.ensure(blocks, 8)
    assert len(blocks) == 2
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        alloc.ensure(blocks, 9)
    alloc.release(blocks)
    assert blocks == [] and len(alloc.free) == 2
