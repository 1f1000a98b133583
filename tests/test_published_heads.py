"""Draft heads in the layouts people download, loaded as vLLM loads them, on tiny targets built
by transformers (tests/hf_models.py).

Head folders are written here in the published layout (names, dtype, file format, the extra
tensors): EAGLE-1 as yuhuili/EAGLE-LLaMA3-Instruct-8B (``pytorch_model.bin``, ``embed_tokens``
copy, ``fc.bias``), EAGLE-3 as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (``.bin``, ``d2t``/``t2d``,
``draft_vocab_size`` < vocab) and as a Qwen3 EAGLE-3 head (bf16 safetensors, own
``embed_tokens``, aux ids under ``eagle_config``), MiMo as XiaomiMiMo/MiMo-7B (ONE sharded folder:
the target + ``model.mtp_layers.0.*``, found with no ``speculative_config.model``).

Random heads: speculative greedy == plain greedy, padded and ragged. Hand-built heads on
"cycle" targets (hf_models.cycle_weights: the next token is a fixed function of the current
one) predict the target exactly: every draft is accepted (acceptance length K + 1).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import hf_models as H
from helpers import tiny_model
from specdec.config import SpeculativeConfig
from specdec.engine.llm import LLM
from specdec.models.heads import Eagle3Head, EagleHead, MtpHead, build_head
from specdec.proposers.factory import load_checked_head

K = 3
MAX_TOKENS = 24
PROMPTS = [[3, 100, 250, 41], list(range(60, 83)), [9, 8]]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
INIT = 0.2


# ---- writing head folders in the published layouts -------------------------------------------
def head_config(target_dir, **kw) -> dict:
    """A one-layer head config.json in the Hub (transformers-4) spelling, sized like the target."""
    c = H.t4_spelling(H.read_config(target_dir))
    for key in ("auto_map", "num_nextn_predict_layers", "layer_types", "generation_config"):
        c.pop(key, None)
    c.update(num_hidden_layers=1, model_type="llama", torch_dtype="float16",
             tie_word_embeddings=False, **kw)
    return c


def layer_tensors(prefix, c, gen, in_features, input_layernorm=True) -> dict:
    """A Llama decoder layer's tensors (q/k/v reading ``in_features``), random."""
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    hq, hkv, inter = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    shapes = {"self_attn.q_proj.weight": (hq, in_features), "self_attn.k_proj.weight": (hkv, in_features),
              "self_attn.v_proj.weight": (hkv, in_features), "self_attn.o_proj.weight": (h, hq),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    out = {prefix + k: INIT * torch.randn(s, generator=gen) for k, s in shapes.items()}
    norms = ["post_attention_layernorm"] + (["input_layernorm"] if input_layernorm else [])
    out.update({f"{prefix}{n}.weight": 1 + 0.1 * torch.randn(h, generator=gen) for n in norms})
    return out


def target_tensor(target_dir, name) -> torch.Tensor:
    from safetensors import safe_open
    index = json.loads((Path(target_dir) / "model.safetensors.index.json").read_text())
    with safe_open(str(Path(target_dir) / index["weight_map"][name]), "pt") as f:
        return f.get_tensor(name)


def save_head(path, config, tensors, fmt, dtype) -> Path:
    path = Path(path)
    path.mkdir(parents=True)
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    if fmt == "bin":
        torch.save(cast, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in cast.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    H.write_config(path, dict(config, torch_dtype=str(dtype).removeprefix("torch.")))
    return path


def write_eagle1(path, target_dir, *, seed=1, dtype=torch.float16, tensors=None) -> Path:
    """yuhuili/EAGLE-*: "bias" in the config, pytorch_model.bin: embed_tokens (the target's),
    fc.weight + fc.bias, layers.0.* without input_layernorm."""
    c = head_config(target_dir, architectures=["LlamaForCausalLM"], bias=True,
                    max_position_embeddings=2048, pad_token_id=0, use_cache=True,
                    transformers_version="4.28.1")
    gen = torch.Generator().manual_seed(seed)
    h = c["hidden_size"]
    t = {"embed_tokens.weight": target_tensor(target_dir, "model.embed_tokens.weight"),
         "fc.weight": INIT * torch.randn(h, 2 * h, generator=gen),
         "fc.bias": 0.1 * torch.randn(h, generator=gen),
         **layer_tensors("layers.0.", c, gen, h, input_layernorm=False)}
    return save_head(path, c, tensors(t, c) if tensors else t, "bin", dtype)


def write_eagle3(path, target_dir, *, seed=2, draft_vocab=96, fmt="bin", dtype=torch.float16,
                 own_embed=False, aux=(0, 1, 1), aux_under_eagle_config=False,
                 tensors=None) -> Path:
    """yuhuili/EAGLE3-* (.bin, fp16, no embed_tokens) or a Qwen3 EAGLE-3 head (safetensors,
    bf16, own embed_tokens): midlayer.*, fc [H, 3H], norm, lm_head [draft_vocab, H], d2t int64
    offsets to a sorted subset of the target vocab, t2d bool mask of it."""
    c = head_config(target_dir, architectures=["LlamaForCausalLMEagle3"],
                    draft_vocab_size=draft_vocab)
    if aux is not None:
        if aux_under_eagle_config:
            c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux),
                                 "use_aux_hidden_state": True}
        else:
            c["eagle_aux_hidden_state_layer_ids"] = list(aux)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = c["hidden_size"], c["vocab_size"]
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    t = {"fc.weight": INIT * torch.randn(h, 3 * h, generator=gen),
         "norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
         "lm_head.weight": INIT * torch.randn(draft_vocab, h, generator=gen),
         "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
         **layer_tensors("midlayer.", c, gen, 2 * h)}
    t["midlayer.hidden_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    if own_embed:
        t["embed_tokens.weight"] = INIT * torch.randn(vocab, h, generator=gen)
    return save_head(path, c, tensors(t, c) if tensors else t, fmt, dtype)


# ---- folders (built once per module) ----------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("published")


@pytest.fixture(scope="module")
def llama(root):
    return H.build_llama31(root / "llama31")


@pytest.fixture(scope="module")
def qwen3(root):
    return H.build_qwen3(root / "qwen3")


@pytest.fixture(scope="module")
def mimo(root):
    return H.build_mimo(root / "mimo")


CASES = {  # case -> (target fixture, method, head writer or None: the target folder itself)
    "eagle1-llama31": ("llama", "eagle", lambda p, t: write_eagle1(p, t)),
    "eagle3-llama31": ("llama", "eagle3", lambda p, t: write_eagle3(p, t)),
    "eagle3-qwen3": ("qwen3", "eagle3", lambda p, t: write_eagle3(
        p, t, fmt="safetensors", dtype=torch.bfloat16, own_embed=True, draft_vocab=128,
        aux_under_eagle_config=True)),
    "mtp-mimo": ("mimo", "mtp", None),
}


@pytest.fixture(scope="module")
def case_dirs(root, request):
    """case -> (target folder, head folder or None); written on first use."""
    cache = {}

    def get(case):
        if case not in cache:
            fixture, _, writer = CASES[case]
            target = request.getfixturevalue(fixture)
            cache[case] = (target, writer(root / case, target) if writer else None)
        return cache[case]
    return get


_plain = {}


def plain(target_dir, prompts=PROMPTS):
    key = (str(target_dir), json.dumps(prompts))
    if key not in _plain:
        _plain[key] = [o.token_ids for o in LLM(model=target_dir, **ENGINE).generate(
            prompts, max_tokens=MAX_TOKENS, ignore_eos=True)]
    return _plain[key]


def spec_llm(target_dir, method, head_dir, padded=True, **kw):
    spec = {"method": method, "num_speculative_tokens": K,
            "disable_padded_drafter_batch": not padded}
    if head_dir is not None:
        spec["model"] = str(head_dir)
    return LLM(model=target_dir, speculative_config=spec, **ENGINE, **kw)


# ---- 1. published layouts load and are lossless ---------------------------------------------
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
@pytest.mark.parametrize("case", list(CASES))
def test_published_head_loads_and_is_lossless(case_dirs, case, padded):
    target_dir, head_dir = case_dirs(case)
    method = CASES[case][1]
    llm = spec_llm(target_dir, method, head_dir, padded)
    head = llm.runner.proposer.head
    if case == "eagle1-llama31":  # fc.bias applied; the embed_tokens copy is fp16, the
        # target fp32: not identical, so the head keeps its own (vLLM: has_own_embed_tokens)
        assert type(head) is EagleHead and head.fc.bias is not None
        assert hasattr(head, "embed_tokens")
        torch.testing.assert_close(head.embed_tokens.weight, head.shared.embed_tokens.weight,
                                   rtol=1e-3, atol=1e-3)
    elif case == "eagle3-llama31":
        assert type(head) is Eagle3Head and head.draft_vocab_size == 96
        assert not hasattr(head, "embed_tokens") and head.aux_layer_ids == (0, 1, 1)
        assert head.d2t.dtype == torch.int64 and int(head.d2t.max()) > 0
    elif case == "eagle3-qwen3":
        assert type(head) is Eagle3Head and head.aux_layer_ids == (0, 1, 1)
        assert head.embed_tokens.weight.shape == (512, 64)
        assert not torch.equal(head.embed_tokens.weight, head.shared.embed_tokens.weight)
        assert head.midlayer.self_attn.head_dim == 32  # the Qwen3 target's head_dim
    else:
        assert type(head) is MtpHead
        assert head.model.mtp_layers[0].self_attn.qkv_proj.bias is not None  # a Qwen2 layer
        want = target_tensor(target_dir, "model.mtp_layers.0.input_proj.weight")
        assert torch.equal(head.model.mtp_layers[0].input_proj.weight, want)
    outs = llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in outs] == plain(target_dir)
    assert all(sum(o.num_drafted) > 0 for o in outs)


def test_mtp_without_model_uses_the_sibling_folder_unless_the_target_holds_mtp_layers(
        root, mimo):
    """A MiMo folder whose weights lack model.mtp_layers.* is not its own head: the sibling
    mtp/ folder (the embedded default model's layout) is used, else the error says why."""
    bare = H.copy_folder(mimo, root / "bare" / "target")
    H.set_tensors(bare, {k: None for k in json.loads(
        (bare / "model.safetensors.index.json").read_text())["weight_map"]
        if k.startswith(H.MTP_PREFIX)})
    with pytest.raises(ValueError, match=r"no config.json.*is a MiMoForCausalLM checkpoint, "
                                         r"but its files hold no MTP layer's tensors"):
        spec_llm(bare, "mtp", None)
    from specdec.engine.llm import DEFAULT_MODEL  # a Llama: no MTP layer of its own
    llama = H.copy_folder(DEFAULT_MODEL, root / "llama" / "target")
    with pytest.raises(ValueError, match=r"no config.json.*is not a MiMoForCausalLM, "
                                         r"DeepseekV3ForCausalLM, .* checkpoint holding its MTP"):
        spec_llm(llama, "mtp", None)
    shutil.copytree(mimo, root / "bare" / "mtp")  # a head folder beside the target
    head = spec_llm(bare, "mtp", None).runner.proposer.head
    assert torch.equal(head.model.mtp_layers[0].input_proj.weight,
                       target_tensor(mimo, "model.mtp_layers.0.input_proj.weight"))


def test_the_mtp_loader_never_reads_the_targets_tensors(root, mimo):
    """In a MiMo folder the head reads model.mtp_layers.* only: the target's own tensors are
    never opened, the two shared copies only have their shapes checked (NaN there: unnoticed)."""
    from specdec.models.heads import load_head
    from specdec.models.registry import load_model
    target = load_model(mimo)
    poisoned = H.copy_folder(mimo, root / "poisoned")
    H.set_tensors(poisoned, {name: torch.full_like(target_tensor(mimo, name), float("nan"))
                             for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight",
                                          "lm_head.weight", "model.embed_tokens.weight")})
    head = load_head(poisoned, target)
    assert torch.equal(head.model.mtp_layers[0].input_proj.weight,
                       target_tensor(mimo, "model.mtp_layers.0.input_proj.weight"))
    H.set_tensors(poisoned, {"lm_head.weight": torch.zeros(7, 64)})
    with pytest.raises(ValueError, match=r"wrong shapes \['lm_head.weight: \(7, 64\) != \(512, 64\)'"):
        load_head(poisoned, target)


# ---- 2. acceptance at maximum -----------------------------------------------------------------
def cycle_mlp_rotation(c, prefix, gen_weight=8.0) -> dict:
    """MLP tensors that add (R - I) h on dims 1, 2 of a cycle embedding h (R: rotation by one
    angle step), i.e. move h to the next token's embedding: gate reads the constant dim 0
    (silu(gate) ~ gen_weight on channels 0, 1), up = (R - I) h / rms, down = rms / silu."""
    h, inter, eps = c["hidden_size"], c["intermediate_size"], c["rms_norm_eps"]
    rms = ((H.CYCLE_CONST ** 2 + 1) / h + eps) ** 0.5
    psi = 2 * torch.pi / len(H.CYCLE)
    rot = torch.tensor([[torch.cos(torch.tensor(psi)), -torch.sin(torch.tensor(psi))],
                        [torch.sin(torch.tensor(psi)), torch.cos(torch.tensor(psi))]],
                       dtype=torch.float64) - torch.eye(2, dtype=torch.float64)
    g = torch.tensor(gen_weight, dtype=torch.float64)
    gate, up, down = torch.zeros(inter, h), torch.zeros(inter, h), torch.zeros(h, inter)
    gate[0:2, 0] = float(g * rms / H.CYCLE_CONST)
    up[0:2, 1:3] = rot.float()
    down[1, 0] = down[2, 1] = float(rms / torch.nn.functional.silu(g))
    return {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": down}


def exact_eagle3(t, c):
    """fc picks the first aux state (= embed(t_i): the cycle target's layers add nothing);
    attention adds nothing (o_proj 0); the MLP rotates it to embed(t_{i+1}); the draft lm_head
    holds the target's CYCLE rows (d2t: draft id k -> CYCLE[k]): it drafts t_{i+2}."""
    h = c["hidden_size"]
    t["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, 2 * h)), dim=1)
    t["midlayer.self_attn.o_proj.weight"].zero_()
    t.update(cycle_mlp_rotation(c, "midlayer."))
    t["midlayer.post_attention_layernorm.weight"].fill_(1.0)
    t["norm.weight"].fill_(1.0)
    t["lm_head.weight"] = torch.stack([H.cycle_row(k, h) for k in range(len(H.CYCLE))]).float()
    t["d2t"] = torch.tensor(H.CYCLE) - torch.arange(len(H.CYCLE))
    t["t2d"] = torch.zeros(c["vocab_size"], dtype=torch.bool).index_fill(0, torch.tensor(H.CYCLE), True)
    return t


def exact_eagle1(t, c):
    """fc passes the embedding (fc = [I | 0]), the layer adds nothing: the shared lm_head sees
    embed(t), i.e. the target's own map up to a positive scale (norm weight 1)."""
    h = c["hidden_size"]
    t["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    t["fc.bias"].zero_()
    t["layers.0.self_attn.o_proj.weight"].zero_()
    t["layers.0.mlp.down_proj.weight"].zero_()
    return t


def exact_mtp(h, inter) -> dict:
    """input_proj passes token_layernorm(embed) (the second half: HIDDEN FIRST), the layer adds
    nothing, final_layernorm keeps the direction: the shared lm_head sees the target's map."""
    p = H.MTP_PREFIX
    return {p + "input_proj.weight": torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1),
            p + "token_layernorm.weight": torch.ones(h), p + "final_layernorm.weight": torch.ones(h),
            p + "self_attn.o_proj.weight": torch.zeros(h, h),
            p + "mlp.down_proj.weight": torch.zeros(h, inter)}


@pytest.fixture(scope="module")
def exact(root):
    """method -> (cycle target folder, exact head folder or None)."""
    llama = H.build_llama31_cycle(root / "cycle-llama31")
    mimo = H.build_mimo_cycle(root / "cycle-mimo")
    c = H.read_config(mimo)
    H.set_tensors(mimo, exact_mtp(c["hidden_size"], c["intermediate_size"]))
    return {"eagle3": (llama, write_eagle3(root / "exact-eagle3", llama, draft_vocab=len(H.CYCLE),
                                           dtype=torch.float32, tensors=exact_eagle3)),
            "eagle": (llama, write_eagle1(root / "exact-eagle1", llama, dtype=torch.float32,
                                          tensors=exact_eagle1)),
            "mtp": (mimo, None)}


def cycle_tokens(prompt, n=MAX_TOKENS):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = H.cycle_next(t)
        out.append(t)
    return out


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
@pytest.mark.parametrize("method", ["eagle3", "mtp", "eagle"])
def test_exact_head_accepts_every_draft(exact, method, padded):
    target_dir, head_dir = exact[method]
    llm = spec_llm(target_dir, method, head_dir, padded)
    if method == "eagle":  # its embed_tokens is the fp32 target's, exactly: shared
        assert not hasattr(llm.runner.proposer.head, "embed_tokens")
    outs = llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [o.token_ids for o in outs] == [cycle_tokens(p) for p in PROMPTS]
    for o in outs:
        assert o.num_drafted == [o.num_decode_steps] * K and o.num_decode_steps >= 5
        assert o.num_accepted == o.num_drafted and o.acceptance_length == K + 1


# ---- 3. aux layer ids: head config > draft_model_config > vLLM's default --------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 4-layer target (default aux ids (2, 2, 1)) and an EAGLE-3 head saved without ids."""
    root = tmp_path_factory.mktemp("aux")
    target = tiny_model()
    build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[0, 1, 2]).save_pretrained(
        root / "ids")
    shutil.copytree(root / "ids", root / "none")
    c = H.read_config(root / "none")
    del c["eagle_aux_hidden_state_layer_ids"]
    H.write_config(root / "none", c)
    return target, root


@pytest.mark.parametrize("head,dmc,want", [
    ("ids", {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, (0, 1, 2)),  # the head's own
    ("ids", {}, (0, 1, 2)),  # the head config's (another configured list: refused, below)
    ("none", {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, (1, 2, 3)),  # then the spec's
    ("none", {"hf_config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 0, 0]}}},
     (3, 0, 0)),
    ("none", {}, (2, 2, 1)),  # then (2, L // 2, L - 3) for L = 4
])
def test_aux_layer_ids_precedence(small, head, dmc, want):
    target, root = small
    spec = SpeculativeConfig("eagle3", K, model=str(root / head), draft_model_config=dmc)
    loaded = load_checked_head(spec, target, model_dir=None, draft_head=None,
                               dtype=torch.float32, device=torch.device("cpu"))
    assert loaded.aux_layer_ids == want and spec.aux_layer_ids(4) == want


def test_the_engine_runs_the_head_configs_aux_layers(small):
    """The head's own ids run; a configured list that differs is refused by name (vLLM
    would take the head's silently), the same list is accepted."""
    target, root = small
    spec = {"method": "eagle3", "num_speculative_tokens": K, "model": str(root / "ids")}
    assert LLM(target=target, speculative_config=spec, **ENGINE).runner.aux_layer_ids == (0, 1, 2)
    same = {**spec, "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}
    assert LLM(target=target, speculative_config=same, **ENGINE).runner.aux_layer_ids == (0, 1, 2)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids=\[1, 2, 3\]: "
                                         r".* combines target layers \[0, 1, 2\]"):
        LLM(target=target, speculative_config={
            **spec, "draft_model_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}},
            **ENGINE)


@pytest.mark.parametrize("head,match", [
    ("ids", r"eagle_aux_hidden_state_layer_ids=\[1, 2\]: .* combines target layers"),
    ("none", r"eagle_aux_hidden_state_layer_ids=\[1, 2\] \(from speculative_config."
             r"draft_model_config\): need 3"),
])
def test_aux_layer_ids_of_the_wrong_count_name_the_field(small, head, match):
    target, root = small
    spec = SpeculativeConfig("eagle3", K, model=str(root / head),
                             draft_model_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})
    with pytest.raises(ValueError, match=match):
        load_checked_head(spec, target, model_dir=None, draft_head=None,
                          dtype=torch.float32, device=torch.device("cpu"))


# ---- 4. refusals ------------------------------------------------------------------------------
def drop(name):
    def edit(t, c):
        del t[name]
        return t
    return edit


@pytest.mark.parametrize("kind,missing", [
    ("eagle", "layers.0.mlp.up_proj.weight"),
    ("eagle", "fc.bias"),  # the config says "bias": true
    ("eagle3", "midlayer.hidden_norm.weight"),
    ("mtp", H.MTP_PREFIX + "input_proj.weight"),
])
def test_a_missing_tensor_is_named(root, llama, mimo, kind, missing):
    where = root / f"missing-{kind}-{missing}"
    if kind == "eagle":
        head, target = write_eagle1(where, llama, tensors=drop(missing)), llama
    elif kind == "eagle3":
        head, target = write_eagle3(where, llama, tensors=drop(missing)), llama
    else:  # the MiMo folder itself, one MTP tensor short
        head = target = H.copy_folder(mimo, where)
        H.set_tensors(target, {missing: None})
    with pytest.raises(ValueError, match=rf"missing tensors \['{missing}'\]"):
        spec_llm(target, kind, head if kind != "mtp" else None)


def test_d2t_outside_the_vocab_is_named(root, llama):
    def bad(t, c):
        t["d2t"][-1] += c["vocab_size"]
        return t
    head = write_eagle3(root / "bad-d2t", llama, tensors=bad)
    with pytest.raises(ValueError, match=r"bad-d2t.*d2t\[95\]=\d+ maps draft id 95 to \d+, "
                                         r"outside the target vocab \[0, 512\)"):
        spec_llm(llama, "eagle3", head)


# ---- 5. a graph backend -----------------------------------------------------------------------
def test_replay_backend_equals_eager(case_dirs):
    target_dir, head_dir = case_dirs("eagle3-qwen3")
    runs = []
    for backend in (None, "replay"):
        llm = spec_llm(target_dir, "eagle3", head_dir, graph_backend=backend,
                       capture_sizes=[1, 2, 4])
        outs = llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        runs.append([(o.token_ids, o.num_accepted) for o in outs])
        if backend == "replay":
            assert llm.runner.proposer.step_graph.calls > 0
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[1]] == plain(target_dir)


# ---- 6. heads for targets with family keys ------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "minimax_m2"])
def test_heads_of_family_targets_build_save_and_load(root, family, tmp_path):
    from specdec.models.heads import load_head
    from specdec.models.layers.mlp import MLP
    from specdec.models.registry import load_model
    target = load_model(H.build(family, root / family))
    for method in ("mtp", "eagle", "eagle3"):
        torch.manual_seed(0)
        extra = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]} if method == "eagle3" else {}
        head = build_head(method, target, **extra)
        config = head.config.to_hf_dict(head.FAMILY)
        assert not {"use_qk_norm", "qk_norm_type", "attn_type_list", "layer_types"} & set(config)
        if method != "mtp":  # a Llama-style head: a dense MLP
            layer = head.layers[0] if method == "eagle" else head.midlayer
            assert type(layer.mlp) is MLP and "num_local_experts" not in config
        head.save_pretrained(tmp_path / method, torch.float32)
        loaded = load_head(tmp_path / method, target)
        assert type(loaded) is type(head)
        for name, t in head.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], t), name


# ---- 7. EAGLE-3 in the speculators format (RedHatAI/*-speculator.eagle3) -------------------------
def write_speculators(path, eagle_dir, edit=None) -> Path:
    """The EAGLE-layout head of ``eagle_dir`` rewritten as a ``speculators`` folder: the Llama
    keys under ``transformer_layer_config``, the EAGLE-3 keys at the top, ``speculators_config``
    (speculative_tokens 5, unused: K comes from the speculative config), ``midlayer.*`` stored
    as ``layers.0.*``, safetensors. ``norm_before_residual`` is written only when false
    (absent means true in this format)."""
    from safetensors.torch import load_file
    c = H.read_config(eagle_dir)
    top = {k: c.pop(k) for k in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
                                 "norm_before_residual", "torch_dtype") if k in c}
    if top.get("norm_before_residual", False) is True:
        del top["norm_before_residual"]
    else:
        top["norm_before_residual"] = False
    config = dict(top, architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                  speculators_version="0.1.0", norm_before_fc=False, has_no_defaults_at_init=False,
                  target_hidden_size=c["hidden_size"],
                  auto_map={"": "eagle3.Eagle3SpeculatorConfig"},
                  transformer_layer_config=dict(c, architectures=["LlamaForCausalLM"]),
                  speculators_config={
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                            "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                      "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                   "architectures": ["LlamaForCausalLM"]}})
    tensors = {k.replace("midlayer.", "layers.0.", 1): v
               for k, v in load_file(str(Path(eagle_dir) / "model.safetensors")).items()}
    path = Path(path)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    H.write_config(path, edit(config) if edit else config)
    return path


@pytest.fixture(scope="module")
def speculators_dirs(root, llama):
    """norm_before_residual -> (EAGLE-layout folder, the same weights as a speculators folder)."""
    out = {}
    for nbr in (False, True):
        eagle = write_eagle3(root / f"eagle-layout-{nbr}", llama, fmt="safetensors",
                             dtype=torch.float32)
        H.write_config(eagle, dict(H.read_config(eagle), norm_before_residual=nbr))
        out[nbr] = (eagle, write_speculators(root / f"speculators-{nbr}", eagle))
    return out


def draft_logits(head, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = head.config.hidden_size
    aux = torch.randn(2, 5, 3 * h, generator=gen)
    ids = torch.randint(0, head.config.vocab_size, (2, 5), generator=gen)
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        logits_hidden, _ = head(ids, positions, head.combine_hidden_states(aux))
        return head.compute_logits(logits_hidden)


@pytest.mark.parametrize("nbr", [False, True], ids=["residual-raw", "norm-before-residual"])
def test_speculators_layout_equals_the_eagle_layout(speculators_dirs, llama, nbr):
    from specdec.models.heads import load_head
    from specdec.models.registry import load_model
    target = load_model(llama)
    eagle_dir, spec_dir = speculators_dirs[nbr]
    eagle, spec = load_head(eagle_dir, target), load_head(spec_dir, target)
    assert type(spec) is Eagle3Head and spec.midlayer.norm_before_residual is nbr
    assert spec.aux_layer_ids == (0, 1, 1) and spec.draft_vocab_size == 96
    assert spec.state_dict().keys() == eagle.state_dict().keys()
    for name, t in eagle.state_dict().items():
        assert torch.equal(spec.state_dict()[name], t), name
    want = draft_logits(eagle)
    assert torch.equal(draft_logits(spec), want)
    # the flag is honoured: the other setting of the same weights drafts differently
    other = load_head(speculators_dirs[not nbr][0], target)
    other.load_state_dict(eagle.state_dict())
    assert not torch.allclose(draft_logits(other), want)
    runs = []
    for head_dir in (eagle_dir, spec_dir):  # K from the speculative config, not the head's 5
        outs = spec_llm(llama, "eagle3", head_dir).generate(PROMPTS, max_tokens=MAX_TOKENS,
                                                             ignore_eos=True)
        runs.append([(o.token_ids, o.num_drafted, o.num_accepted) for o in outs])
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[1]] == plain(llama)


def _set(path, value):
    def edit(c):
        *outer, key = path
        d = c
        for k in outer:
            d = d[k]
        d[key] = value
        return c
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set(["speculators_model_type"], "eagle"), r"speculators_model_type='eagle': only 'eagle3'"),
    (_set(["speculators_config", "algorithm"], "medusa"),
     r"speculators_config.algorithm='medusa': only 'eagle3'"),
    (_set(["norm_before_fc"], True), r"norm_before_fc=True: only false"),
    (_set(["fusion_bias"], True), r"keys \['fusion_bias'\]: not supported"),
    (_set(["target_hidden_size"], 128), r"target_hidden_size=128: must equal hidden_size=64"),
    (_set(["norm_before_residual"], "yes"), r"norm_before_residual='yes': must be true or false"),
], ids=["model-type", "algorithm", "norm-before-fc", "unknown-key", "target-hidden",
        "nbr-type"])
def test_a_speculators_config_that_changes_the_math_is_refused(speculators_dirs, root, llama,
                                                               edit, match):
    from specdec.models.heads import load_head
    from specdec.models.registry import load_model
    where = root / f"speculators-bad-{len(list(root.glob('speculators-bad-*')))}"
    head = write_speculators(where, speculators_dirs[False][0], edit=edit)
    with pytest.raises(ValueError, match=match):
        load_head(head, load_model(llama))
