"""SpeculativeConfig: which proposer runs, how many tokens it drafts, and how.

Built from a vLLM-style dict, e.g.
``{"method": "mtp", "num_speculative_tokens": 3, "disable_padded_drafter_batch": false}``.
"""

import json
from dataclasses import dataclass, field, fields
from itertools import pairwise

# vLLM's per-architecture MTP method names (``MTPModelTypes`` in vllm/config/speculative.py);
# like vLLM, every one of them is normalised to "mtp".
MTP_ALIASES = (
    "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
    "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
    "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
    "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "kimi_k3_mtp",
    "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
    "inkling_mtp", "glm5_next_mtp",
)
METHODS = ("mtp", "eagle", "eagle3", "draft_model", "extract_hidden_states", "ngram", "suffix")
# Methods that draft on the host from the request's own tokens: no head, no draft step.
HOST_DRAFT_METHODS = ("ngram", "suffix")
NGRAM_DEFAULT_N = 5  # vLLM's prompt_lookup_min/max when neither is given
# suffix decoding's keys -> (vLLM's default, type, lowest allowed, highest allowed)
SUFFIX_KEYS = {"suffix_decoding_max_tree_depth": (24, int, 1, None),
               "suffix_decoding_max_cached_requests": (10000, int, 0, None),
               "suffix_decoding_max_spec_factor": (1.0, float, 0.0, None),
               "suffix_decoding_min_token_prob": (0.1, float, 0.0, 1.0)}
# The step wrapper backend (specdec.graphs) of capturable steps: "eager": none;
# "torchair": one compiled graph per bucket (torchair on Ascend, torch.compile elsewhere;
# "torchair" + "mtp" is Torchair-MTP); "full_cuda_graph": the target step and the draft step
# each captured as one CUDA graph per bucket (CUDA only).
GRAPH_MODES = ("eager", "torchair", "full_cuda_graph")
FULL_GRAPH_MODES = ("torchair", "full_cuda_graph")
# Methods whose head reads the target's intermediate ("aux") hidden states.
AUX_HIDDEN_STATE_METHODS = ("eagle3", "extract_hidden_states")
K_POLICIES = ("goodput",)  # num_speculative_tokens_policy values (specdec/engine/k_policy.py)
# Methods that draft a tree (speculative_token_tree): a head or draft model run on the device
TREE_METHODS = ("mtp", "eagle", "eagle3", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str  # one of METHODS after normalisation (MTP aliases become "mtp")
    num_speculative_tokens: int  # K >= 1
    disable_padded_drafter_batch: bool = False  # True: ragged (host-synced) drafter batch
    draft_model_config: dict = field(default_factory=dict)  # draft HF config overrides
    model: str | None = None  # path of the draft head folder (draft_model: the draft LM's)
    graph_mode: str | None = None  # one of GRAPH_MODES; None: the device's default backend
    # ngram (vLLM's keys): the n-gram sizes matched against the request's tokens; one given
    # sets both, neither gives NGRAM_DEFAULT_N (as vLLM)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix (vLLM's keys, SUFFIX_KEYS): None = vLLM's default
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    # K per step (vLLM's key): [[lo, hi, k], ...], inclusive batch-size ranges -> the step's K
    # (0 <= k <= num_speculative_tokens; 0 switches speculation off); a batch size in no
    # range drafts num_speculative_tokens. None: K every step
    num_speculative_tokens_per_batch_size: list | None = None
    # "goodput": each step's K (at most the schedule's above) is the one the engine's measured
    # acceptance and step times say emits the most tokens per second (engine/k_policy.py).
    # None: the K above
    num_speculative_tokens_policy: str | None = None
    # a draft tree (issue 53; ``draft_tree.py``): each step verifies a tree of drafts,
    # num_speculative_tokens its depth. Static: vLLM's key, the tree's paths of child ranks
    # (e.g. "[(0,), (1,), (0, 0)]"), the same tree every step. None: a chain of K drafts
    speculative_token_tree: str | list | None = None
    # Dynamic (EAGLE-2; SGLang's --speculative-eagle-topk / --speculative-num-draft-tokens,
    # num_speculative_tokens its --speculative-num-steps): each step the head's tree_topk
    # best children per frontier node, and the num_draft_tokens best scored nodes verified,
    # the root (the last known token) included, as SGLang counts them. Both or neither
    tree_topk: int | None = None
    num_draft_tokens: int | None = None
    # a dynamic tree scores a candidate by the head's log-softmax of logits / this (a sampled
    # request's: / its temperature when higher), summed along its path (the drafts stay each
    # node's top-k; only which are kept changes). None: the head's config.json
    # ``tree_score_temperature`` (specdec/train/tree_temperature.py fits it), else 1
    # (EAGLE-2's and SGLang's raw draft probabilities)
    tree_score_temperature: float | None = None

    def __post_init__(self):
        if not isinstance(self.method, str):
            raise TypeError(f"method must be a str, got {self.method!r}")
        if self.method in MTP_ALIASES:
            self.method = "mtp"
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not supported; "
                             f"allowed: {METHODS + MTP_ALIASES}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool):
            raise TypeError(f"num_speculative_tokens must be an int, got {k!r}")
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k} must be >= 1")
        if not isinstance(self.disable_padded_drafter_batch, bool):
            raise TypeError("disable_padded_drafter_batch must be a bool, "
                            f"got {self.disable_padded_drafter_batch!r}")
        if not isinstance(self.draft_model_config, dict):
            raise TypeError(f"draft_model_config must be a dict, got {self.draft_model_config!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise TypeError(f"model must be a str path or None, got {self.model!r}")
        if self.graph_mode is not None and self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode={self.graph_mode!r} is not supported; "
                             f"allowed: {GRAPH_MODES}")
        if self.graph_mode not in (None, "eager") and self.method == "extract_hidden_states":
            raise ValueError(f"graph_mode={self.graph_mode!r} with method='extract_hidden_states'"
                             " (it runs no draft step); allowed: 'eager'")
        if self.disable_padded_drafter_batch and self.graph_mode in FULL_GRAPH_MODES:
            # A ragged batch has a data-dependent token count: it cannot replay a full graph.
            raise ValueError(f"disable_padded_drafter_batch=True cannot run with "
                             f"graph_mode={self.graph_mode!r}; allowed: 'eager'")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method='draft_model' needs speculative_config.model: the folder "
                             "of a causal LM with the target's tokenizer")
        if self.model is not None and (self.method in HOST_DRAFT_METHODS
                                       or self.method == "extract_hidden_states"):
            raise ValueError(f"model={self.model!r}: method={self.method!r} loads no draft "
                             "folder; allowed: None")
        self._check_draft_model_config()
        self._check_prompt_lookup()
        self._check_suffix_keys()
        self._check_k_schedule()
        self._check_k_policy()
        self._check_tree()
        ids = self.aux_layer_ids_configured
        if ids is not None and (not isinstance(ids, (list, tuple)) or not ids or any(
                not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids={ids!r} must be a non-empty "
                             "list of layer indices >= 0")
        if self.method == "extract_hidden_states":
            if k != 1:
                raise ValueError(f"num_speculative_tokens={k} with method='extract_hidden_states'"
                                 "; allowed: 1")
            if self.disable_padded_drafter_batch:
                raise ValueError("disable_padded_drafter_batch=True with "
                                 "method='extract_hidden_states'; allowed: False")
            if ids is None:
                raise ValueError("method='extract_hidden_states' needs "
                                 "draft_model_config.eagle_aux_hidden_state_layer_ids")

    def _draft_model_configs(self) -> list[tuple[str, object]]:
        """(where, value) of each place the aux layer ids may sit, in the order they are
        looked up: draft_model_config, its ``eagle_config``, its ``hf_config`` (as vLLM nests
        them), and that one's ``eagle_config``; None where absent."""
        dmc = self.draft_model_config
        hf_config = dmc.get("hf_config")
        hf = hf_config if isinstance(hf_config, dict) else {}
        return [("draft_model_config", dmc),
                ("draft_model_config.eagle_config", dmc.get("eagle_config")),
                ("draft_model_config.hf_config", hf_config),
                ("draft_model_config.hf_config.eagle_config", hf.get("eagle_config"))]

    def _check_draft_model_config(self) -> None:
        """draft_model_config holds what is read of it, nothing else: the aux layer ids
        (methods that read the target's aux hidden states; ``_draft_model_configs``) and
        extract_hidden_states' ``output_dir`` / ``overwrite_output_dir``."""
        ids = "eagle_aux_hidden_state_layer_ids"
        top = {"extract_hidden_states": (ids, "eagle_config", "hf_config", "output_dir",
                                         "overwrite_output_dir"),
               "eagle3": (ids, "eagle_config", "hf_config")}.get(self.method, ())
        allowed = {"draft_model_config": top,
                   "draft_model_config.hf_config": (ids, "eagle_config")}
        for where, d in self._draft_model_configs():
            if d is None:
                continue
            if not isinstance(d, dict):
                raise TypeError(f"{where} must be a dict, got {d!r}")
            keys = allowed.get(where, (ids,))
            if bad := sorted(set(d) - set(keys)):
                raise ValueError(f"{where} has keys {bad} that method={self.method!r} does not "
                                 f"read; allowed: {list(keys)}")

    def _check_prompt_lookup(self) -> None:
        """ngram's n-gram sizes: ints >= 1, min <= max; one given sets the other (vLLM)."""
        given = {name: getattr(self, name) for name in ("prompt_lookup_min", "prompt_lookup_max")
                 if getattr(self, name) is not None}
        if self.method != "ngram":
            if given:
                raise ValueError(f"{sorted(given)[0]}={next(iter(given.values()))!r} is a key "
                                 f"of method='ngram', not method={self.method!r}")
            return
        for name, value in given.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: allowed an int >= 1")
        lo = self.prompt_lookup_min or self.prompt_lookup_max or NGRAM_DEFAULT_N
        hi = self.prompt_lookup_max or self.prompt_lookup_min or NGRAM_DEFAULT_N
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_suffix_keys(self) -> None:
        """suffix's keys in range (vLLM's defaults for the ones not given); refused for other
        methods."""
        for name, (default, kind, lo, hi) in SUFFIX_KEYS.items():
            value = getattr(self, name)
            if self.method != "suffix":
                if value is not None:
                    raise ValueError(f"{name}={value!r} is a key of method='suffix', not "
                                     f"method={self.method!r}")
                continue
            if value is None:
                setattr(self, name, default)
                continue
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and (kind is float or isinstance(value, int))
                  and value >= lo and (hi is None or value <= hi))
            if not ok:
                allowed = f"a number in [{lo}, {hi}]" if hi is not None else \
                    f"{'an int' if kind is int else 'a number'} >= {lo}"
                raise ValueError(f"{name}={value!r}: allowed {allowed}")

    def _check_k_schedule(self) -> None:
        """num_speculative_tokens_per_batch_size: [lo, hi, k] int triples, 1 <= lo <= hi,
        0 <= k <= num_speculative_tokens, ranges disjoint; stored as tuples."""
        name, table = "num_speculative_tokens_per_batch_size", \
            self.num_speculative_tokens_per_batch_size
        if table is None:
            return
        if self.method == "extract_hidden_states":
            raise ValueError(f"{name} with method='extract_hidden_states' (it drafts nothing); "
                             "allowed: None")
        if not isinstance(table, (list, tuple)) or not table:
            raise ValueError(f"{name}={table!r}: allowed a non-empty list of [lo, hi, k]")
        k = self.num_speculative_tokens
        entries = []
        for i, e in enumerate(table):
            ok = (isinstance(e, (list, tuple)) and len(e) == 3
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in e))
            if not ok or not 1 <= e[0] <= e[1] or not 0 <= e[2] <= k:
                raise ValueError(f"{name}[{i}]={e!r}: allowed [lo, hi, k] ints with "
                                 f"1 <= lo <= hi and 0 <= k <= num_speculative_tokens={k}")
            entries.append(tuple(e))
        entries.sort()
        for a, b in pairwise(entries):
            if b[0] <= a[1]:
                raise ValueError(f"{name}: batch-size ranges {list(a)} and {list(b)} overlap")
        self.num_speculative_tokens_per_batch_size = entries

    def _check_k_policy(self) -> None:
        policy, name = self.num_speculative_tokens_policy, "num_speculative_tokens_policy"
        if policy is None:
            return
        if policy not in K_POLICIES:
            raise ValueError(f"{name}={policy!r}; allowed: {K_POLICIES} or None")
        if self.method == "extract_hidden_states":
            raise ValueError(f"{name}={policy!r} with method='extract_hidden_states' (it "
                             "drafts nothing); allowed: None")

    def _check_tree(self) -> None:
        """speculative_token_tree: a tree of paths (``StaticTree.from_paths``) whose depth is
        num_speculative_tokens, for the methods that draft on the device with a head; refused
        with what it cannot run with; or, for suffix, num_draft_tokens alone (``HostTree``)."""
        keys = ("num_draft_tokens", "tree_topk", "tree_score_temperature",
                "speculative_token_tree")
        if self.method == "suffix" and any(getattr(self, key) is not None for key in keys):
            self._check_suffix_tree()
        elif self.tree_topk is not None or self.num_draft_tokens is not None:
            self._check_dynamic_tree()
        elif self.tree_score_temperature is not None:
            raise ValueError(f"tree_score_temperature={self.tree_score_temperature!r} scores "
                             "a dynamic tree's candidates: give tree_topk and num_draft_tokens, "
                             "or None")
        elif self.speculative_token_tree is None:
            return
        name = self.tree_option
        if self.method not in TREE_METHODS + ("suffix",):
            raise ValueError(f"{name} with method={self.method!r}: no tree drafting for it; "
                             f"allowed methods: {TREE_METHODS} (and suffix, with "
                             "num_draft_tokens alone)")
        for key, why in (("disable_padded_drafter_batch", "the ragged drafter drafts chains"),
                         ("num_speculative_tokens_per_batch_size", "a tree has one shape"),
                         ("num_speculative_tokens_policy", "the policy picks chain lengths")):
            if getattr(self, key):
                raise ValueError(f"{key}={getattr(self, key)!r} with {name} ({why}); "
                                 f"allowed: {False if key.startswith('disable') else None}")
        if self.speculative_token_tree is None:
            return
        from specdec.draft_tree import StaticTree
        tree = StaticTree.from_paths(self.speculative_token_tree)
        if tree.max_depth != self.num_speculative_tokens:
            raise ValueError(f"{name} is {tree.max_depth} deep and num_speculative_tokens="
                             f"{self.num_speculative_tokens}: num_speculative_tokens is the "
                             f"tree's depth; give {tree.max_depth}")
        self.speculative_token_tree = [tuple(p) for p in tree.paths]

    @property
    def tree_option(self) -> str:
        """The key that asks for this config's tree, as messages name it:
        speculative_token_tree (static), num_draft_tokens (suffix's tree) or tree_topk
        (a dynamic tree)."""
        return ("speculative_token_tree" if self.speculative_token_tree is not None
                else "num_draft_tokens" if self.method == "suffix" else "tree_topk")

    def _check_suffix_tree(self) -> None:
        """Suffix decoding's tree: num_draft_tokens alone, an int in 2 .. MAX_TREE_NODES (its
        shape follows the suffix counts each step, so no top-k, score temperature or static
        paths)."""
        from specdec.draft_tree import MAX_TREE_NODES
        for key, why in (("tree_topk", "its branching follows its counts"),
                         ("tree_score_temperature", "it scores by counts, not a head's logits"),
                         ("speculative_token_tree", "its shape follows its counts each step")):
            if getattr(self, key) is not None:
                raise ValueError(f"{key}={getattr(self, key)!r} with method='suffix' (a suffix "
                                 f"tree: {why}); allowed: None (num_draft_tokens alone sizes "
                                 "the tree)")
        n = self.num_draft_tokens
        if (not isinstance(n, int) or isinstance(n, bool)
                or not 2 <= n <= MAX_TREE_NODES):
            raise ValueError(f"num_draft_tokens={n!r}: the root and at most num_draft_tokens "
                             f"- 1 suffix drafts; allowed an int in 2 .. {MAX_TREE_NODES}")

    def _check_dynamic_tree(self) -> None:
        """tree_topk and num_draft_tokens: both ints, a tree of at most MAX_TREE_NODES nodes
        the candidates can fill and deep enough for num_speculative_tokens (its depth), no
        static tree beside them."""
        from specdec.draft_tree import MAX_TREE_NODES, DynamicTree, check_score_temperature
        k, n, depth = self.tree_topk, self.num_draft_tokens, self.num_speculative_tokens
        if self.speculative_token_tree is not None:
            raise ValueError("tree_topk / num_draft_tokens (a dynamic tree) with "
                             "speculative_token_tree (a static one): give one of them")
        for key, value in (("tree_topk", k), ("num_draft_tokens", n)):
            if value is None or not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: a dynamic tree needs tree_topk and "
                                 "num_draft_tokens, ints")
        shape = DynamicTree(k, n, depth)
        if k < 1 or 1 + shape.head_rows > MAX_TREE_NODES:
            raise ValueError(f"tree_topk={k}: allowed 1 <= tree_topk and (num_speculative_"
                             f"tokens - 1) * tree_topk <= {MAX_TREE_NODES - 1}")
        if not depth + 1 <= n <= min(MAX_TREE_NODES, 1 + shape.num_candidates):
            raise ValueError(f"num_draft_tokens={n}: the root and its drafts; allowed "
                             f"{depth + 1} .. {min(MAX_TREE_NODES, 1 + shape.num_candidates)} "
                             f"(a tree num_speculative_tokens={depth} deep holds at least "
                             f"{depth} drafts; tree_topk={k} gives {shape.num_candidates} "
                             "candidates)")
        if self.tree_score_temperature is not None:
            check_score_temperature(self.tree_score_temperature, "tree_score_temperature")

    @property
    def tree(self):
        """The ``StaticTree``, ``DynamicTree`` or ``HostTree`` (suffix: at most
        num_draft_tokens - 1 drafts, at most num_speculative_tokens deep) each step verifies,
        or None (a chain)."""
        from specdec.draft_tree import DynamicTree, HostTree, StaticTree
        if self.method == "suffix" and self.num_draft_tokens is not None:
            n = self.num_draft_tokens
            return HostTree(n, min(self.num_speculative_tokens, n - 1))
        if self.tree_topk is not None:
            return DynamicTree(self.tree_topk, self.num_draft_tokens,
                               self.num_speculative_tokens, self.tree_score_temperature)
        if self.speculative_token_tree is None:
            return None
        return StaticTree.from_paths(self.speculative_token_tree)

    @property
    def num_fed_drafts(self) -> int:
        """Drafts a decoding request feeds the target per step: the tree's nodes past its
        root, or K (a chain)."""
        tree = self.tree
        return self.num_speculative_tokens if tree is None else tree.num_nodes - 1

    def k_for_batch_size(self, batch_size: int) -> int:
        """The K of a step that runs ``batch_size`` requests (the schedule's, else K)."""
        for lo, hi, k in self.num_speculative_tokens_per_batch_size or ():
            if lo <= batch_size <= hi:
                return k
        return self.num_speculative_tokens

    @property
    def step_ks(self) -> tuple[int, ...]:
        """Every K a step can run, ascending (one for a fixed K; 0..K under a policy)."""
        if self.num_speculative_tokens_policy is not None:
            return tuple(range(self.num_speculative_tokens + 1))
        return tuple(sorted({self.num_speculative_tokens, *(
            k for _, _, k in self.num_speculative_tokens_per_batch_size or ())}))

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise TypeError(f"speculative config must be a dict, got {type(d).__name__}")
        allowed = tuple(f.name for f in fields(cls))
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; allowed: {allowed}")
        if d.get("method") == "suffix" and "num_speculative_tokens" not in d:  # as vLLM
            depth = d.get("suffix_decoding_max_tree_depth")
            if depth is None:
                depth = SUFFIX_KEYS["suffix_decoding_max_tree_depth"][0]
            elif not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
                raise ValueError(f"suffix_decoding_max_tree_depth={depth!r}: allowed an int "
                                 ">= 1 (it is also K when num_speculative_tokens is not given)")
            d = {**d, "num_speculative_tokens": depth}
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative config needs {key!r}; got keys {sorted(d)}")
        return cls(**d)

    @classmethod
    def from_json(cls, s: str) -> "SpeculativeConfig":
        return cls.from_dict(json.loads(s))

    @property
    def is_padded(self) -> bool:
        """True for the default padded drafter batch (no host-device sync)."""
        return not self.disable_padded_drafter_batch

    @property
    def uses_aux_hidden_states(self) -> bool:
        return self.method in AUX_HIDDEN_STATE_METHODS

    @property
    def aux_layer_ids_configured(self) -> list[int] | None:
        """`eagle_aux_hidden_state_layer_ids` from draft_model_config, top level or under
        `hf_config` (as vLLM nests it), each also under `eagle_config` (as vLLM reads a head
        config), or None when not set. For EAGLE-3 a head config naming its own ids takes
        precedence over these (see ``specdec.proposers.factory``)."""
        key = "eagle_aux_hidden_state_layer_ids"
        return next((d[key] for _, d in self._draft_model_configs()
                     if isinstance(d, dict) and d.get(key) is not None), None)

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose outputs feed the head: the configured ids, else vLLM's
        default (2, L // 2, L - 3), held inside [0, L). E.g. L = 32 -> (2, 16, 29)."""
        n = num_target_layers
        ids = self.aux_layer_ids_configured
        ids = tuple(ids) if ids is not None else default_aux_layer_ids(n)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(ids)} has {bad} outside "
                             f"[0, {n}) for a target with num_target_layers={n}")
        return ids


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers of an L-layer target: (2, L // 2, L - 3), each held
    inside [0, L) (vLLM's formula leaves the target below 4 layers: L = 2 -> (1, 1, 0))."""
    n = num_target_layers
    return tuple(min(max(i, 0), n - 1) for i in (2, n // 2, n - 3))
