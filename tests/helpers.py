"""Shared test builders: tiny seeded models and heads, engines over them, dense references,
a tiny model saved to disk (with its fixtures) and the ways to corrupt it.

Engine tests use ``tiny_target``/``tiny_head`` (float64, vocab 96) and ``moe_target``; model
tests use ``tiny_model``/``tiny_model_head`` (float32, vocab 61, non-trivial norms and biases).
"""

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.commands.cli import main
from specdec.engine.dp_engine import rank_context
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.heads import build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

VOCAB = 96

AUX = [1, 2, 3]
# a batch mixing short and long prompts; a 16-token budget forces chunked prefill
PROMPTS = [[5, 9, 13], list(range(1, 41)), [7], [(i * 7) % VOCAB for i in range(23)], [3, 3]]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      eos_token_id=VOCAB - 1)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def tiny_head(method: str, target: LlamaForCausalLM, seed: int = 1):
    """A random head of ``method`` for ``target``; ``draft_model``: a random 2-layer Llama
    of its vocabulary (a DraftLM, the object standing for the draft model's folder)."""
    torch.manual_seed(seed)
    if method == "draft_model":
        from specdec.models.draft_lm import DraftLM
        cfg = ModelConfig(vocab_size=target.config.vocab_size, hidden_size=16,
                          intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, eos_token_id=target.config.vocab_size - 1)
        return DraftLM(LlamaForCausalLM(cfg).to(torch.float64))
    extra = {"eagle_aux_hidden_state_layer_ids": AUX} if method == "eagle3" else {}
    return build_head(method, target, **extra).to(torch.float64).eval()


def drafts_after_prefill(llm, prompt) -> tuple[list[int], list[int]]:
    """One request's drafts and their parents after its prefill (the drafts its first
    decode step verifies)."""
    req = llm.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while req.is_prefilling:
        llm.step()
    return req.spec_token_ids, req.spec_parents


def dense_greedy(target: LlamaForCausalLM, prompt: list[int], max_tokens: int,
                 max_model_len: int) -> list[int]:
    """Plain greedy decoding with full dense recomputation (no KV cache, no engine)."""
    ids = list(prompt)
    out = []
    with torch.inference_mode():
        while len(out) < max_tokens and len(ids) < max_model_len:
            x = torch.tensor([ids])
            hidden, _ = target(x, torch.arange(len(ids))[None])
            tok = int(target.compute_logits(hidden[0, -1]).argmax())
            ids.append(tok)
            out.append(tok)
            if tok == target.config.eos_token_id:
                break
    return out


def make_llm(target, method, k, padded, head=None, tree=None, **kw):
    """``tree``: a speculative_token_tree of depth ``k``, or a dynamic tree's keys."""
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": k,
                "disable_padded_drafter_batch": not padded}
        if isinstance(tree, dict):
            spec.update(tree)
        elif tree is not None:
            spec["speculative_token_tree"] = tree
        if method == "eagle3":
            spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
        if method == "draft_model":  # ``head``, a DraftLM, stands for its folder
            spec["model"] = "draft"
    kw.setdefault("max_num_batched_tokens", 16)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 4)
    return LLM(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64, **kw)


def moe_config(num_experts=6, top_k=2, norm_topk_prob=False, **kw) -> ModelConfig:
    extra = {"num_experts": num_experts, "num_experts_per_tok": top_k,
             "moe_intermediate_size": 24, "norm_topk_prob": norm_topk_prob}
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, eos_token_id=VOCAB - 1)
    return ModelConfig(**{**base, **kw}, extra=extra)


def moe_target(seed: int = 0) -> LlamaForCausalLM:
    """A tiny float64 Llama whose every MLP is a 6-expert top-2 MoE."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(moe_config()).to(torch.float64).eval()


def tiny_config(**kw) -> ModelConfig:
    d = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2)
    d.update(kw)
    return ModelConfig(**d)


def tiny_model(seed=0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw))
    with torch.no_grad():  # non-trivial norms and biases so every tensor matters
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else torch.randn_like(p))
    return model.eval()


def tiny_model_head(method, target, seed=1):
    extra = dict(eagle_aux_hidden_state_layer_ids=[1, 2, 3], draft_vocab_size=40) if method == "eagle3" else {}
    torch.manual_seed(seed)
    head = build_head(method, target, **extra)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        if method == "eagle3":
            head.d2t.copy_(torch.randint(0, 21, (40,)).sort().values)
    return head.eval()


class ReferenceKV:
    """One sequence: concatenate k/v per layer on every call; causal within the new tokens."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attend(self, layer_idx, q, k, v):
        k = torch.cat((self.k.get(layer_idx, k[:0]), k))
        v = torch.cat((self.v.get(layer_idx, v[:0]), v))
        self.k[layer_idx], self.v[layer_idx] = k, v
        n, total, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
        scores = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(rep, 1)) / q.shape[-1] ** 0.5
        allowed = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hnm,mhd->nhd", probs, v.repeat_interleave(rep, 1))


def head_inputs(method, target, ids):
    """Target states for a head: [1, T, H] final hidden or [1, T, 3, H] aux."""
    t = ids.shape[-1]
    hidden, aux = target(ids, torch.arange(t), aux_layer_ids=(1, 2, 3) if method == "eagle3" else ())
    return aux if method == "eagle3" else hidden


# ---- a tiny model on disk (errors, the README promise) ----------------------------------------
MAX_POS = 128


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_exit_2(code, err, *needles):
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def truncate(path: Path) -> None:
    data_ = path.read_bytes()
    path.write_bytes(data_[:len(data_) // 2])


def set_tensor(path: Path, name: str, fn) -> None:
    tensors = load_file(str(path))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path))


CORRUPTIONS = {
    "truncated target weights": ("target/model.safetensors", truncate, "not a readable"),
    "truncated head weights": ("eagle3/model.safetensors", truncate, "not a readable"),
    "config.json is a list": ("target/config.json", lambda p: p.write_text("[1, 2]"),
                              "must be a JSON object"),
    "config.json is not JSON": ("target/config.json", lambda p: p.write_text("{bad"),
                                "not valid JSON"),
    "head config.json is not JSON": ("eagle3/config.json", lambda p: p.write_text("{"),
                                     "not valid JSON"),
    "corrupted tokenizer.json": ("target/tokenizer.json", lambda p: p.write_text("{bad"),
                                 "not a readable tokenizer"),
    "d2t outside the target vocab": (
        "eagle3/model.safetensors",
        lambda p: set_tensor(p, "d2t", lambda t: t + 10_000), "d2t[0]=10000"),
    "NaN in a target weight": (
        "target/model.safetensors",
        lambda p: set_tensor(p, "model.layers.1.mlp.up_proj.weight",
                             lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
        "'model.layers.1.mlp.up_proj.weight' holds non-finite"),
    "all-NaN lm_head": ("target/model.safetensors",
                        lambda p: set_tensor(p, "lm_head.weight",
                                             lambda t: torch.full_like(t, float("nan"))),
                        "'lm_head.weight' holds non-finite"),
    "inf in a head weight": ("eagle3/model.safetensors",
                             lambda p: set_tensor(p, "fc.weight",
                                                  lambda t: t.fill_(float("inf"))),
                             "'fc.weight' holds non-finite"),
    "eos_token_id outside the vocab": (
        "target/config.json",
        lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "eos_token_id": 10**6})),
        "eos_token_id=1000000"),
}


class ServerThread:
    """uvicorn serving ``app`` on a free port in a daemon thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = app
        import uvicorn  # the serve stack only where a test serves (not on a torch-only box)

        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "server did not shut down"


def metrics(url: str) -> dict:
    """{sample name + labels: value} from a server's /metrics, parsed by prometheus_client."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics").text
    return {s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name: s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


LONG_PROMPT = [1, 2, 3, 4, 5, 6, 1, 2] * 8  # 64 tokens: chunked at max_num_batched_tokens=32
ARRIVING = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.7, seed=11),
            SamplingParams(max_tokens=16, ignore_eos=True),
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5),
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7),
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, top_p=0.9)]


def run_arrivals(llm, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """LONG_PROMPT (two chunks at a 32-token budget), then one of ``prompts`` every third step
    while the others decode, with ARRIVING's sampling (greedy and sampled, seeded and not):
    most steps mix prefill chunks with decodes. Returns each request's tokens and
    per-position acceptance."""
    pending = list(zip([LONG_PROMPT, *prompts], ARRIVING))
    reqs, i = [], 0
    while True:
        if pending and i % 3 == 0:
            reqs.append(llm.add_request(*pending.pop(0)))
        i += 1
        if llm.step() is None and not pending:
            break
    return [r.output_token_ids for r in reqs], [r.num_accepted for r in reqs]


def uniform_flags(llm, monkeypatch) -> list[bool]:
    """Filled per step of ``llm`` from now on: whether the runner planned it as a uniform
    decode (``monkeypatch`` wraps its execute)."""
    flags, execute = [], llm.runner.execute

    def recording(batch):
        flags.append(batch.plan.uniform_decode)
        return execute(batch)
    monkeypatch.setattr(llm.runner, "execute", recording)
    return flags


def folder_builder(builders: dict, tmp_path_factory):
    """name -> the checkpoint folder ``builders[name](path)`` wrote, built once per session."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = builders[name](tmp_path_factory.mktemp(name) / "model")
        return cache[name]
    return get


def run_ranks(target, args: tuple, world: int, timeout: float) -> dict:
    """Start ``world`` processes ``target(rank, *args, results)`` as the engine starts CPU
    ranks (``rank_context``: forked from a server that imported the engine once); each puts
    one (rank, result) on ``results``. -> {rank: result}; stragglers are killed."""
    ctx = rank_context({"cpu"})
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie waiting for its reaper has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@contextmanager
def held_steps(llm):
    """``llm.step`` waits (up to 30 s) for the yielded Event: a server admits requests and
    runs none of them until it is set; set and restored on leaving."""
    release, step = threading.Event(), llm.step

    def held():
        release.wait(30)
        return step()
    llm.step = held
    try:
        yield release
    finally:
        release.set()
        llm.step = step
