"""Training helpers: the unrolled draft attention, greedy generation, acceptance statistics."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specdec.train import data
from specdec.train.acceptance import (acceptance_stats, draft_chain, greedy_generate,
                                      real_text_agreement, repeated_ngram_share)
from specdec.train.kv import UnrolledKV
from specdec.train.train_default import head_loss, lr_at, make_optimizer

from helpers import tiny_model, tiny_model_head, ReferenceKV, head_inputs


def test_split_rule_is_a_fixed_hash():
    # int("b4fa779c", 16) % 20 == 0 for "ast.py"; int("3b2e3cb3", 16) % 20 == 19 for "json/decoder.py"
    assert data.is_held_out("ast.py")
    assert not data.is_held_out("json/decoder.py")


def test_acceptance_stats_worked_example():
    x = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    drafts = torch.zeros(1, 7, 3, dtype=torch.int64)
    drafts[0, 0] = torch.tensor([7, 8, 0])  # slot 0 proposes x[2], x[3], x[4]: right, right, wrong
    drafts[0, 1] = torch.tensor([0, 9, 10])  # slot 1: first draft wrong -> nothing accepted
    drafts[0, 2] = torch.tensor([9, 10, 11])  # slot 2: all three right
    stats = acceptance_stats(x, drafts, prompt_len=0)
    assert stats["slots"] == 3
    assert stats["per_position"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert stats["mean_acceptance_length"] == pytest.approx((3 + 1 + 4) / 3)


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_unrolled_chain_equals_sequential_engine_chain(method):
    """UnrolledKV step s at slot i == the engine's draft: cache of step-1 entries 0..i, then the
    chain's own entries at positions i+1.. (checked for every slot, 3 steps)."""
    target = tiny_model()
    head = tiny_model_head(method, target)
    x = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        drafts = draft_chain(target, head, x, 3)[0]  # [T, 3]
        hidden = head.combine_hidden_states(head_inputs(method, target, x))[0]  # [T, H]
        ids = torch.cat((x[0, 1:], x[0, -1:]))
        for i in range(6):
            kv = ReferenceKV()
            lh, h = head(ids[: i + 1], torch.arange(i + 1), hidden[: i + 1], kv)
            tok, h = head.draft_to_target_ids(head.compute_logits(lh[-1:]).argmax(-1)), h[-1:]
            chain = [tok]
            for s in range(1, 3):
                lh, h = head(tok, torch.tensor([i + s]), h, kv)
                tok = head.draft_to_target_ids(head.compute_logits(lh).argmax(-1))
                chain.append(tok)
            assert torch.cat(chain).tolist() == drafts[i].tolist(), i


@given(b=st.integers(1, 3), p=st.integers(1, 5), n=st.integers(1, 4))
def test_greedy_generate_matches_dense_argmax_loop(b, p, n):
    target = tiny_model()
    prompts = torch.randint(0, 61, (b, p), generator=torch.Generator().manual_seed(b * 10 + p))
    got = greedy_generate(target, prompts, n, chunk=2)
    seq = prompts
    with torch.no_grad():
        for _ in range(n):
            hidden, _ = target(seq, torch.arange(seq.shape[1]))
            seq = torch.cat((seq, target.compute_logits(hidden[:, -1]).argmax(-1, keepdim=True)), 1)
    assert torch.equal(got, seq)


def test_unrolled_kv_mask_example():
    """The docstring's T = 2, step-2 mask, observed through attention weights on unit values."""
    kv = UnrolledKV(batch=1, seqlen=2)
    q = torch.zeros(2, 1, 1)  # equal scores: output = mean of the visible values
    kv.attend(0, q, torch.zeros(2, 1, 1), torch.tensor([[[1.0]], [[2.0]]]))
    out = kv.attend(0, q, torch.zeros(2, 1, 1), torch.tensor([[[10.0]], [[20.0]]]))
    # slot 0 sees {1, 10}; slot 1 sees {1, 2, 20}
    assert out.flatten().tolist() == pytest.approx([5.5, 23 / 3])


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_head_loss_decreases_and_keeps_target_frozen(method):
    target = tiny_model()
    for p in target.parameters():
        p.requires_grad_(False)
    head = tiny_model_head(method, target)
    head.train()
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, aux = target(x, torch.arange(12), aux_layer_ids=(1, 2, 3))
        teacher = target.compute_logits(hidden)
    draft_ids = torch.arange(40) if method == "eagle3" else None  # tiny_model_head: draft vocab 40
    opt = make_optimizer(head, 1e-2)
    losses = []
    for _ in range(20):
        loss, agree = head_loss(head, x, hidden, aux, teacher, draft_ids, 3, 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # soft cross-entropy = teacher entropy + KL: the KL part must at least halve
    restricted = teacher[..., draft_ids] if draft_ids is not None else teacher
    entropy = sum(torch.distributions.Categorical(logits=restricted[:, s:]).entropy().mean()
                  for s in (1, 2, 3)).item() / 3
    assert len(agree) == 3 and losses[-1] - entropy < 0.5 * (losses[0] - entropy), (entropy, losses)
    assert all(p.grad is None for p in target.parameters())


def test_lr_schedule_warms_up_then_decays_to_ten_percent():
    assert lr_at(0, 100, 1.0, warmup=10) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, warmup=10) == pytest.approx(1.0)
    assert lr_at(100, 100, 1.0, warmup=10) == pytest.approx(0.1)


def test_repeated_ngram_share_example():
    assert repeated_ngram_share(torch.tensor([[1, 2, 1, 2, 1]]), start=2, n=2) == 1.0
    assert repeated_ngram_share(torch.tensor([[1, 2, 3, 4, 5]]), start=0, n=2) == 0.0


def test_real_text_agreement_of_a_perfect_head_is_one():
    """A 'head' that returns the target's own next-position logits agrees everywhere."""
    target = tiny_model()
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, _ = target(x, torch.arange(9))

    class Oracle(torch.nn.Module):  # drafts at slot i what the target predicts after x[i+1]
        aux_layer_ids = ()

        def combine_hidden_states(self, h):
            return h

        def forward(self, ids, positions, h, kv=None):
            nxt = torch.cat((hidden[:, 1:], hidden[:, -1:]), dim=1).reshape(-1, h.shape[-1])
            return nxt, nxt

        compute_logits = staticmethod(target.compute_logits)

        def draft_to_target_ids(self, ids):
            return ids

    assert real_text_agreement(target, Oracle(), x) == 1.0
    assert real_text_agreement(target, tiny_model_head("eagle", target), x) < 1.0


@pytest.mark.parametrize("t0", [0.3, 1.0])
def test_the_fitted_tree_temperature_recovers_the_one_that_drew_the_tokens(t0):
    """Tokens drawn from softmax(logits / t0): the grid's least-NLL temperature is t0 within
    the grid's step and the sample's noise."""
    from specdec.train.tree_temperature import best_temperature
    gen = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(20_000, 12, generator=gen)
    truth = torch.multinomial(torch.softmax(logits / t0, -1), 1, generator=gen)[:, 0]
    t, _ = best_temperature(logits, truth)
    assert t == pytest.approx(t0, rel=0.1)


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_temperature_pairs_are_the_depths_whose_earlier_drafts_matched(method):
    """greedy_draft_pairs keeps, per depth s, the slots where drafts 1..s-1 matched (as
    acceptance_stats counts them from draft_chain) and the target's token there as a draft
    id, where the draft vocabulary holds it."""
    from specdec.train.tree_temperature import greedy_draft_pairs
    target = tiny_model()
    head = tiny_model_head(method, target)
    x = greedy_generate(target, torch.randint(0, 61, (3, 4), generator=torch.Generator()
                                              .manual_seed(1)), 12)
    logits, truth = greedy_draft_pairs(target, head, x, 4, 3)
    drafts = draft_chain(target, head, x, 3)
    slots = torch.arange(2, x.shape[1] - 4)
    tokens = torch.stack([x[:, slots + 2 + s] for s in range(3)], -1)
    right = drafts[:, slots] == tokens
    reached = torch.cat((torch.ones_like(right[..., :1]), right[..., :-1].cumprod(-1)), -1)
    drafted = torch.isin(tokens, head.draft_to_target_ids(torch.arange(logits.shape[-1])))
    assert len(truth) == int((reached.bool() & drafted).sum()) == len(logits) > 0
    first = tokens[..., 0][drafted[..., 0]]
    assert head.draft_to_target_ids(truth[:len(first)]).tolist() == first.tolist()


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_a_draft_models_temperature_pairs_are_its_chains_logits_where_drafts_matched(noise):
    """For a draft model greedy_draft_pairs reads one pass over x. Its pairs are, per depth s,
    the slots where the draft model's own chain matched x at depths 1..s-1, with the logits
    that chain computes there: run here slot by slot, dense, fed its own argmax drafts. A copy
    of the target (noise 0) matches everywhere; a perturbed copy only at some slots."""
    from specdec.models.draft_lm import DraftLM
    from specdec.train.tree_temperature import greedy_draft_pairs
    target, copy = tiny_model(), tiny_model()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    x = greedy_generate(target, torch.randint(0, 61, (3, 4), generator=gen), 12)
    k, slots = 3, range(2, x.shape[1] - 4)
    logits, truth = greedy_draft_pairs(target, DraftLM(copy), x, 4, k)
    want_logits, want_truth, depth_of = [], [], []
    with torch.no_grad():
        chains = {}  # (b, i) -> the chain's logits at depths 1..k
        for b in range(x.shape[0]):
            for i in slots:
                seq, steps = x[b, :i + 2].tolist(), []
                for _ in range(k):
                    hidden, _ = copy(torch.tensor([seq]), torch.arange(len(seq))[None])
                    steps.append(copy.compute_logits(hidden[0, -1]).float())
                    seq.append(int(steps[-1].argmax()))
                chains[b, i] = steps, seq[i + 2:]
        for s in range(k):
            for (b, i), (steps, drafts) in chains.items():
                if drafts[:s] == x[b, i + 2:i + 2 + s].tolist():
                    want_logits.append(steps[s])
                    want_truth.append(int(x[b, i + 2 + s]))
                    depth_of.append(s)
    assert truth.tolist() == want_truth
    torch.testing.assert_close(logits, torch.stack(want_logits), atol=1e-4, rtol=1e-4)
    assert (depth_of.count(k - 1) == len(chains)) == (noise == 0)
    assert depth_of.count(k - 1) > 0


def test_a_written_tree_temperature_is_the_loaded_heads(tmp_path):
    """tree_temperature.write puts each fitted T into its head folder's config.json, where
    load_head keeps it for the proposer (a dynamic tree's default score temperature)."""
    from specdec.models.heads import load_head
    from specdec.train.tree_temperature import write
    target = tiny_model()
    tiny_model_head("mtp", target).save_pretrained(tmp_path / "mtp")
    write({"mtp": tmp_path / "mtp"}, {"mtp": {"tree_score_temperature": 0.25}})
    assert load_head(tmp_path / "mtp", target).config.extra["tree_score_temperature"] == 0.25
