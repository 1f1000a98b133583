"""Shared test set-up: the sync check on, a seeded hypothesis profile, a random speculative-step
batch, and a tiny model saved to disk with one engine over it."""

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from specdec.engine.llm import LLM
from specdec.models.heads import build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM
from specdec.train import data

from helpers import AUX, MAX_POS

# every engine step of the suite runs under the host-sync guard (padded: none allowed)
os.environ.setdefault("SPECDEC_CHECK_HOST_SYNCS", "1")
# one torch thread in the processes the suite starts too (the commands run as subprocesses):
# see _one_torch_thread_for_the_suite below
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile("specdec", deadline=None, max_examples=50, derandomize=True)
settings.load_profile("specdec")


@dataclass
class RandomStep:
    """One target step as the proposer sees it (the DESIGN.md vocabulary)."""
    k: int  # num_speculative_tokens
    vocab_size: int
    max_model_len: int
    block_size: int
    sampled: list[list[int]]  # [B][K+1], -1 or >= vocab_size = placeholder
    discard: list[bool]  # [B], partial-prefill chunks
    num_draft: list[int]  # [B], drafts verified this step
    query_lens: list[int]  # [B], scheduled tokens
    num_computed: list[int]  # [B], tokens already in the KV cache
    token_table: torch.Tensor  # [R, max_model_len + 1] int32, -1 = unknown
    rows: torch.Tensor  # [B] int64, each request's row in token_table
    target_ids: torch.Tensor  # [N] int64
    block_table: torch.Tensor  # [Bp, M] int32; rows >= B are graph padding (garbage)

    @property
    def b(self) -> int:
        return len(self.sampled)

    @property
    def seq_lens(self) -> torch.Tensor:  # [B] int32, num_computed + num_scheduled
        return torch.tensor([c + q for c, q in zip(self.num_computed, self.query_lens)],
                            dtype=torch.int32)

    @property
    def query_start_loc(self) -> torch.Tensor:  # [B+1] int32
        return torch.tensor([0, *self.query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @property
    def cu_num_draft_tokens(self) -> torch.Tensor:  # [B] int32, inclusive cumsum
        return torch.tensor(self.num_draft, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @property
    def positions(self) -> torch.Tensor:  # [N] int64
        return torch.cat([torch.arange(c, c + q)
                          for c, q in zip(self.num_computed, self.query_lens)])

    @property
    def backup(self) -> list[int]:  # [B], token_table[row, seq_len] (-1 past the table)
        length = self.token_table.shape[1]
        return [int(self.token_table[r, s]) if s < length else -1
                for r, s in zip(self.rows.tolist(), self.seq_lens.tolist())]


def make_step_batch(b: int, k: int, seed: int) -> RandomStep:
    """B requests: decodes with 0..K drafts and random acceptance, and prefill chunks,
    half of them discarded; ids at the vocab edge; some requests near max_model_len."""
    rng = random.Random(seed)
    vocab = rng.choice([2, 7, 1000])
    max_model_len = rng.randint(k + 8, 80)
    block_size = rng.choice([1, 2, 4, 16])

    def valid_id():
        return rng.choice([0, vocab - 1, rng.randrange(vocab)])

    def placeholder():
        return rng.choice([-1, -1, vocab, vocab + rng.randrange(3)])

    sampled, discard, num_draft, query_lens, num_computed = [], [], [], [], []
    for _ in range(b):
        if rng.random() < 0.6:  # decode: 1 + d tokens, v valid sampled entries
            d = rng.choice([k, k, rng.randint(0, k)])
            q, dropped, v = 1 + d, False, rng.randint(1, d + 1)
        else:  # prefill chunk, no drafts
            d, q, dropped = 0, rng.randint(1, 6), rng.random() < 0.5
            v = 0 if dropped else 1
        row = [valid_id() for _ in range(v)] + [placeholder() for _ in range(k + 1 - v)]
        if dropped and rng.random() < 0.5:
            row[0] = valid_id()  # junk that the discard mask must hide
        if rng.random() < 0.3:  # near the end: the draft loop crosses max_model_len
            c = max(0, max_model_len - q - rng.randint(0, k))
        else:
            c = rng.randint(0, max_model_len - q)
        sampled.append(row)
        discard.append(dropped)
        num_draft.append(d)
        query_lens.append(q)
        num_computed.append(c)

    num_rows = b + rng.randint(0, 4)
    width = max_model_len + 1
    table = torch.full((num_rows, width), -1, dtype=torch.int32)
    rows = torch.tensor(rng.sample(range(num_rows), b), dtype=torch.int64)
    for r, c, q, dropped in zip(rows.tolist(), num_computed, query_lens, discard):
        known = min(width, c + q + (rng.randint(1, 4) if dropped else rng.choice([0, 1])))
        table[r, :known] = torch.tensor([valid_id() for _ in range(known)], dtype=torch.int32)

    pad = rng.randint(0, 3)
    blocks = math.ceil(max_model_len / block_size)
    block_table = torch.tensor([[rng.randrange(10_000) for _ in range(blocks)] for _ in range(b)]
                               + [[rng.choice([-1, 10**6])] * blocks for _ in range(pad)],
                               dtype=torch.int32)
    target_ids = torch.tensor([valid_id() for _ in range(sum(query_lens))], dtype=torch.int64)
    return RandomStep(k, vocab, max_model_len, block_size, sampled, discard, num_draft, query_lens,
                     num_computed, table, rows, target_ids, block_table)


# ---- pytest-xdist (the README's ``python -m pytest -n 2``): a test file is one unit of work, on
# one worker (its module fixtures are built once), except the tests below, units of their own
# sent first: test_graphs.py's compile tests, each minutes of dynamo tracing or inductor
# compiles -- they run beside the rest of the suite instead of after it. One unit per engine
# its tests share (the module's ``warmed`` fixture builds an engine in each worker that asks
# for it). Without -n (a GPU box
# without pytest-xdist included): one process, nothing here runs.
SCHEDULED_FIRST = {  # nodeid -> its unit, in the order they are sent
    f"tests/test_graphs.py::{test}": f"tests/test_graphs.py@{unit}" for test, unit in (
        ("test_compile_dynamic_warms_up_the_serving_paths_and_equals_eager[eagle3]", "eagle3"),
        ("test_compile_dynamic_compiles_nothing_after_start_up[eagle3]", "eagle3"),
        ("test_served_graphs_after_start_up_are_counted_in_metrics[compile_dynamic]", "eagle3"),
        ("test_compile_dynamic_with_inductor_equals_eager_at_the_embedded_models_sizes",
         "inductor"),
        ("test_compile_dynamic_warms_up_the_serving_paths_and_equals_eager[None]", "plain"),
        ("test_compile_dynamic_compiles_nothing_after_start_up[None]", "plain"),
    )} | {
    # inductor's first compile in a process sets up its C++ toolchain (10-30 s cold): the
    # suite's other inductor test runs in the same worker, after the one above
    "tests/test_counter_rng.py::test_inductor_with_symbolic_sizes_draws_the_eager_numbers":
        "tests/test_graphs.py@inductor"}


# then the longest files (tens of seconds each: servers, ranks, subprocesses), so that the run
# ends on short files instead of one worker finishing a long one alone; the rest follow in
# collection order
SENT_EARLY = ("tests/test_serve.py", "tests/test_dp_faults.py", "tests/test_tp.py",
              "tests/test_qwen3_5.py", "tests/test_serve_edges.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n's default distribution (load) and loadfile: file units with SCHEDULED_FIRST's, sent
    in collection order; another --dist is left to xdist."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SCHEDULED_FIRST.get(nodeid) or super()._split_scope(nodeid)

    config.option.loadscopereorder = False  # not largest unit (most tests) first
    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """An xdist worker's collection (the order the units are sent in): SCHEDULED_FIRST's tests
    first, in its order, then SENT_EARLY's files. Outside xdist nothing changes."""
    if hasattr(config, "workerinput"):
        first = {nodeid: i for i, nodeid in enumerate(SCHEDULED_FIRST)}
        early = {path: len(first) + i for i, path in enumerate(SENT_EARLY)}
        items.sort(key=lambda item: first.get(item.nodeid, early.get(
            item.nodeid.partition("::")[0], len(first) + len(early))))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_for_the_suite():
    """The suite runs with one torch intra-op thread: its models are tiny, and on 2 cores a
    second intra-op thread spin-waits against the other work of the run (the HTTP servers,
    the spawned ranks, pytest itself) -- the engine process of ``specdec serve`` defaults to
    one thread on 2 CPUs for the same reason. Each test compares engines in this process with
    each other, so every side runs with the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def step_batch():
    """make_step_batch(b, k, seed); session-scoped so hypothesis tests can use it."""
    return make_step_batch


# ---- a tiny model saved to disk, and one engine over it (test_errors, test_readme_promise) --
@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """root/{target,mtp,eagle,eagle3}: a tiny target with a BPE tokenizer and its three heads."""
    root = tmp_path_factory.mktemp("errors")
    tok = data.train_tokenizer(data.read_texts(data.list_files()[0][:3]), 300)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      eos_token_id=0, max_position_embeddings=MAX_POS)
    target = LlamaForCausalLM(cfg).eval()
    target.save_pretrained(root / "target", dtype=torch.float32)
    tok.save(str(root / "target" / "tokenizer.json"))
    for method in ("mtp", "eagle", "eagle3"):
        extra = dict(eagle_aux_hidden_state_layer_ids=AUX, draft_vocab_size=48) \
            if method == "eagle3" else {}
        build_head(method, target, **extra).save_pretrained(root / method, dtype=torch.float32)
    return root


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    """One shared engine (EAGLE-3, K=2); every test leaves it idle."""
    return LLM(folder / "target", {"method": "eagle3", "num_speculative_tokens": 2},
               max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The module runs with one torch thread (model comparisons: faster on 2 shared cores,
    and the same reduction order every run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

