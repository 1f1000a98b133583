"""``specdec.LLM``: the front -- check arguments, load a target (+ draft head), take requests,
``generate``. One rank's steps run in its ``EngineCore`` (engine/core.py); a launcher of
data/tensor-parallel ranks builds none and hands ``generate`` to ``dp_engine``."""

from dataclasses import replace
from pathlib import Path

import torch

from specdec.checks import check_bool
from specdec.distributed import TPContext
from specdec.dp import DPContext
from specdec.engine import chat_template
from specdec.engine.config import EngineConfig
from specdec.engine.core import EngineCore
from specdec.engine.dp_engine import (exit_if_a_rank_reran_the_script,
                                      generate_across_ranks, parallel_role)
from specdec.engine.inputs import DEFAULT_MODEL  # re-exported too
from specdec.engine.inputs import (as_prompt_list, checkpoint_dtype, encode_prompt,
                                   load_target, main_dtype, parse_speculative_config,
                                   sampling_params_per_prompt)
from specdec.engine.outputs import RequestOutput, StepRecord
from specdec.engine.parallel_sampling import fan_in, fan_out
from specdec.engine.sequence import Request, SamplingParams
from specdec.graphs import resolve_backend
from specdec.linear_state import has_linear_attention
from specdec.models.heads import SharedWeights
from specdec.models.layers.moe import has_cross_rank_layers
from specdec.models.layers.parallel import ExpertPlacement, check_shardable
from specdec.proposers.base import HeadProposer
from specdec.proposers.factory import load_checked_head
from specdec.proposers.registry import PROPOSERS, get_proposer_class


# SamplingParams fields a tree step does not apply yet -> their off value
TREE_REFUSED_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                         "frequency_penalty": 0.0, "min_tokens": 0}


class LLM:
    def __init__(self, model: str | Path | None = None, speculative_config=None, *,
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int = 256, block_size: int = 16,
                 dtype: str | torch.dtype = "auto", device: str | None = None, seed: int = 0,
                 capture_sizes: list[int] | None = None, tensor_parallel_size: int = 1,
                 sequence_parallel: bool = False, dp: DPContext | None = None,
                 data_parallel_size: int = 1, data_parallel_timeout: float = 600.0,
                 tp: TPContext | None = None,
                 target=None, draft_head=None, tokenizer=None,
                 graph_backend: str | None = None, compile_backend: str | None = None,
                 check_host_syncs: bool | None = None, async_scheduling: bool = False,
                 enforce_eager: bool = False, gpu_memory_utilization: float | None = None,
                 enable_expert_parallel: bool = False,
                 enable_prefix_caching: bool | None = None, pack_prefill: bool | None = None):
        """Check everything (on a launcher too, before any rank starts), then build this
        rank's engine; a launcher (data_parallel_size or tensor_parallel_size > 1, no
        dp/tp given) builds none: ``generate`` spawns the ranks (``dp_engine``).
        ``device`` None: the accelerator when one is present, else cpu; ``dtype`` "auto": the
        checkpoint's torch_dtype, float32 on a CPU (``EngineConfig``), a given ``target``'s
        own dtype. ``max_num_seqs`` None: 16, or with ``gpu_memory_utilization`` (an
        accelerator's memory share for weights + KV cache) the most rows that share holds.
        ``enforce_eager=True``: ``graph_backend="eager"`` (vLLM's name).
        ``enable_expert_parallel`` (vLLM's name): a MoE target's routed experts are split whole
        over the data x tensor parallel ranks (else by expert over the DP ranks, by width over
        the TP ranks; ``models.layers.parallel.ExpertPlacement``).
        ``enable_prefix_caching`` (vLLM's name; None: on): requests reuse the KV blocks (the
        target's and the drafter's) of prompt prefixes computed before (``block_allocator``;
        a hybrid linear-attention target's through state snapshots); refused when True for
        extract_hidden_states, which None turns off (``startup`` says so).
        ``pack_prefill``: prefill chunks fill each step's token budget; off, a step that ends
        a prompt holds no chunk of a prompt it cannot end, so that first token waits for no
        later prompt's work (``engine.scheduler``); None: off on a CPU unless a head or draft
        model runs in each step, on elsewhere (``EngineConfig.resolve_pack_prefill``)."""
        # what each rank is built from (specdec.engine.dp_engine)
        self.init_kwargs = {k: v for k, v in locals().items() if k not in (
            "self", "dp", "tp", "data_parallel_size", "data_parallel_timeout")}
        if check_bool("enforce_eager", enforce_eager):
            if graph_backend not in (None, "eager"):
                raise ValueError(f"enforce_eager=True conflicts with graph_backend="
                                 f"{graph_backend!r}; allowed with it: None or 'eager'")
            graph_backend = "eager"
        if max_num_seqs is None and gpu_memory_utilization is None:
            max_num_seqs = 16
        if (isinstance(dtype, str) and dtype == "auto"
                and callable(getattr(target, "parameters", None))):
            dtype = main_dtype(target)  # nothing is converted: the object's own dtype
        cfg = self.config = EngineConfig(
            max_model_len, max_num_seqs, max_num_batched_tokens, block_size, dtype, device,
            seed, capture_sizes, tensor_parallel_size, sequence_parallel, data_parallel_size,
            data_parallel_timeout, checkpoint_dtype(model) if target is None else None,
            gpu_memory_utilization, enable_prefix_caching, pack_prefill)
        # the ranks take what was chosen here
        self.init_kwargs.update(device=str(cfg.device), dtype=cfg.dtype)
        self.role = parallel_role(cfg, dp, tp)
        self.launcher, self.tp, self.device = self.role.launcher, self.role.tp, cfg.device
        if self.launcher:
            exit_if_a_rank_reran_the_script()  # before loading anything
        self.data_parallel_size = data_parallel_size
        self.spec = parse_speculative_config(speculative_config)
        if draft_head is not None and self.spec is None:
            raise ValueError("draft_head: a head drafts only under a speculative_config; "
                             "give one with its method, or no draft_head")
        if (draft_head is not None and self.spec.model is not None
                and self.spec.method != "draft_model"):  # draft_model: its model is required
            raise ValueError(f"draft_head and speculative_config.model={self.spec.model!r} "
                             "both give the head; give one")
        # a launcher checks on a host copy; only the ranks put weights on the accelerator
        load_on = torch.device("cpu") if self.launcher else cfg.device
        check_bool("enable_expert_parallel", enable_expert_parallel)
        experts = ExpertPlacement() if self.launcher else ExpertPlacement.of(
            self.tp, *((self.role.dp.rank, self.role.dp.size) if self.role.dp else (0, 1)),
            enable_expert_parallel)
        target, self.tokenizer, model = load_target(model, target, tokenizer, cfg.dtype,
                                                    load_on, tp=self.tp, experts=experts)
        if enable_expert_parallel and not has_cross_rank_layers(target):
            raise ValueError(f"enable_expert_parallel=True: {type(target).__name__} has no "
                             "MoE layers; allowed: False")
        cfg.check_model(target.config)
        k = self.spec.num_fed_drafts if self.spec else 0  # a tree's nodes past its root
        cfg.check_num_speculative_tokens(k)
        if self.spec is not None and self.spec.tree is not None:
            self._check_tree(target)
        drafter = get_proposer_class(self.spec) if self.spec is not None else None
        if drafter is not None and not drafter.tensor_parallel and tensor_parallel_size > 1:
            raise ValueError(f"method={self.spec.method!r} with tensor_parallel_size="
                             f"{tensor_parallel_size}: not supported yet; allowed: 1 (data "
                             "parallelism is)")
        self.target = target.eval()
        self.prefix_caching_note = cfg.resolve_prefix_caching(no_prefix_caching(target, drafter))
        cfg.resolve_pack_prefill(drafter is not None and drafter.drafts_on_device)
        self.max_model_len = cfg.max_model_len
        self.vocab_size = target.config.vocab_size
        head = None
        if self.spec is not None:
            if draft_head is not None and self.tp.size > 1:  # heads are replicated; they
                # share the target's sharded embedding and lm_head
                draft_head.shared = SharedWeights(target.model.embed_tokens, target.lm_head)
            if draft_head is None:
                self._check_default_head(drafter, model)
            head = load_checked_head(self.spec, target, model_dir=model, draft_head=draft_head,
                                     dtype=cfg.dtype, device=load_on, tokenizer=self.tokenizer)
        kv_specs = target.kv_cache_spec() + ([] if head is None else head.kv_cache_spec())
        # linear attention: 1 + K state slots per request row, and with prefix caching a
        # staging slot and a snapshot per row (``linear_state.StateCache``)
        slots = 1 + k + 2 * (cfg.enable_prefix_caching and has_linear_attention(target))
        cfg.size_kv_cache(kv_specs, state_slots=slots)
        cfg.check_memory(kv_specs, state_slots=slots)
        dp_size = self.role.dp.size if self.role.dp is not None else data_parallel_size
        self.backend = resolve_backend(
            self.spec.graph_mode if self.spec else None, graph_backend, self.device,
            tensor_parallel_size=tensor_parallel_size, data_parallel_size=dp_size,
            cross_rank=any(has_cross_rank_layers(m) for m in (target, head) if m is not None),
            compile_backend=compile_backend)
        self.graph_backend = self.backend.name
        if check_host_syncs is not None:
            check_bool("check_host_syncs", check_host_syncs)
        self.async_scheduling = check_bool("async_scheduling", async_scheduling)
        if self.async_scheduling:
            self._check_async(tensor_parallel_size, dp_size, drafter)
        self._chat_render = None  # chat(): the folder's chat template, loaded once
        self._next_id = 0  # the next request id the engine gives
        self._ids_given = False  # add_request had a number as a caller's request_id
        self.core = None
        if self.launcher:  # refused here, before any rank starts
            check_shardable(target, tensor_parallel_size, data_parallel_size,
                            enable_expert_parallel)
            return
        self.core = EngineCore(cfg, self.spec, self.target, head, backend=self.backend,
                               dp=self.role.dp or DPContext(), tp=self.tp,
                               check_host_syncs=check_host_syncs,
                               async_scheduling=self.async_scheduling, tokenizer=self.tokenizer)

    def _check_default_head(self, drafter, model_dir: Path | None) -> None:
        """A head method given no ``speculative_config.model`` looks beside the target (the
        sibling ``<method>/`` folder; mtp: also the target folder itself): when none is
        there, say which folder was looked for and how to give one (not a path the caller
        never typed as ``speculative_config.model``)."""
        sibling_rule = HeadProposer.head_folder.__func__  # find_head_dir: mtp, eagle, eagle3
        if (self.spec.model is not None or model_dir is None
                or getattr(drafter.head_folder, "__func__", None) is not sibling_rule):
            return
        try:
            drafter.head_folder(self.spec, model_dir)
        except ValueError as e:
            method = self.spec.method
            sibling = Path(model_dir).resolve().parent / method
            why = str(e).partition("head is needed")[2].rstrip(")")  # mtp: the target's layer
            raise ValueError(
                f"method={method!r} needs its head's folder: no speculative_config.model was "
                f"given, and the default, the target folder's sibling {str(sibling)!r}, has no "
                f"config.json{why}; give the head's folder as speculative_config={{'model': "
                f"DIR}} (command line: --speculative-config '{{\"model\": \"DIR\"}}')"
            ) from None

    def _check_tree(self, target) -> None:
        """A draft tree (any kind): refused where a tree step cannot keep its state."""
        if has_linear_attention(target):
            key = next(k for k in ("speculative_token_tree", "tree_topk", "num_draft_tokens")
                       if getattr(self.spec, k) is not None)
            raise ValueError(
                f"{key}={getattr(self.spec, key)!r} with {type(target).__name__}: its "
                "linear-attention layers keep one recurrent state per draft position of a "
                "chain, not per tree node; allowed: None (chain drafting)")

    def _check_async(self, tensor_parallel_size: int, dp_size: int, drafter) -> None:
        """async_scheduling overlaps a single rank's padded steps: refuse what it cannot."""
        for name, size in (("tensor_parallel_size", tensor_parallel_size),
                           ("data_parallel_size", dp_size)):
            if size > 1:
                raise ValueError(f"async_scheduling=True with {name}={size}: not supported yet;"
                                 " allowed: 1")
        spec = self.spec
        if spec is not None and spec.num_speculative_tokens_policy is not None:
            raise ValueError(f"async_scheduling=True with num_speculative_tokens_policy="
                             f"{spec.num_speculative_tokens_policy!r}: the policy times each "
                             "step, and overlapped steps have no time of their own; allowed: "
                             "None (a num_speculative_tokens_per_batch_size schedule overlaps)")
        if spec is not None and not (drafter.feeds_next_step and spec.is_padded):
            what = ("disable_padded_drafter_batch=True" if not spec.is_padded
                    else f"method={spec.method!r}")
            feeding = ", ".join(m for m, c in PROPOSERS.items() if c.feeds_next_step)
            raise ValueError(f"async_scheduling=True with {what}: the next step's inputs must "
                             "come from the device (a padded head or draft model); allowed: "
                             f"methods {feeding}, padded, or none")

    # ---- what the core holds (None / empty on a launcher) ----------------------------------
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def allocator(self):
        return self.core.allocator

    @property
    def steps(self) -> list[StepRecord]:
        """This process's engine's steps (a DP/TP launcher's stays empty)."""
        return self.core.steps if self.core is not None else []

    @property
    def check_host_syncs(self) -> bool:
        """Whether every step's host syncs are checked (proof machinery: tests, a flag)."""
        return self.core is not None and self.core.check_host_syncs

    @check_host_syncs.setter
    def check_host_syncs(self, value: bool) -> None:
        check_bool("check_host_syncs", value)
        self.init_kwargs["check_host_syncs"] = value  # a launcher's ranks
        if self.core is not None:
            self.core.check_host_syncs = value

    @property
    def startup(self) -> str | None:
        """What start-up spent on step graphs, printed once by the commands, e.g.
        ``"cuda_graph: 6 step graphs captured in 1.9 s"``, and prefix caching turned off
        (``prefix_caching_note``); None when there is neither (eager; a DP/TP launcher,
        whose ranks build the engines, has only the note)."""
        graphs = self.core.startup if self.core is not None else None
        return "; ".join(x for x in (graphs, self.prefix_caching_note) if x) or None

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        """Queue one prompt; ValueError/TypeError (nothing queued) for a bad prompt or params,
        or a ``request_id`` an unfinished request has. None: the engine's next number not in
        use (an unseeded sampled request's random numbers are keyed by its id)."""
        self._check_single_rank("add_request")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params={params!r}: must be a SamplingParams")
        params = self._check_params(params, "params")
        if params.n > 1:
            raise ValueError(f"params.n={params.n}: add_request queues one sample (allowed: "
                             "n=1); generate() runs n samples of a prompt")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id={request_id!r}: must be a str or None")
        if request_id is not None and request_id in self.core.unfinished_ids():
            raise ValueError(f"request_id={request_id!r} is taken by an unfinished request; "
                             "give another, or None (the engine numbers requests)")
        self._ids_given |= request_id is not None and request_id.isdecimal()
        return self._queue(self._prompt_ids(prompt, "prompt"), params, request_id)

    def _check_params(self, params: SamplingParams, name: str) -> SamplingParams:
        """-> the request's own copy of ``params``, every field checked again (a field set
        after construction, ``params.max_tokens = 0``, is refused as at construction; a later
        change to the caller's object does not reach a queued request). Then what
        SamplingParams cannot check alone (``check_model``: stop ids in the vocabulary, a
        tokenizer for stop strings); prompt log-probabilities need a single-rank lm_head
        (under TP it is a collective)."""
        try:
            params = replace(params)
            params.check_model(self.vocab_size, self.target.config.eos_token_ids,
                               self.tokenizer is not None)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}.{e}") from None
        if self.spec is not None and self.spec.tree is not None:
            for field, off in TREE_REFUSED_SAMPLING.items():
                if getattr(params, field) != off:
                    raise ValueError(
                        f"{name}.{field}={getattr(params, field)!r} with {self.spec.tree_option}: "
                        "the penalties and min_tokens count the tokens before each verified "
                        f"position, a chain's; allowed: {off!r} (or chain drafting)")
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError(f"{name}.prompt_logprobs={params.prompt_logprobs}: not supported "
                             f"with tensor_parallel_size={self.config.tensor_parallel_size} "
                             "(allowed: None); output logprobs are")
        return params

    def _queue(self, ids: list[int], params: SamplingParams, request_id: str | None) -> Request:
        """``request_id`` None: the next number, past any a caller's id holds (``_ids_given``:
        a caller gave a number as an id)."""
        if request_id is None:
            taken = self.core.unfinished_ids() if self._ids_given else ()
            while str(self._next_id) in taken:
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        req = Request(request_id, ids, len(ids), params)
        self.core.add(req)
        return req

    def _prompt_ids(self, prompt, name: str) -> list[int]:
        """Token ids of one prompt, checked: ids in the vocab, 1 <= length < max_model_len."""
        ids = encode_prompt(name, prompt, self.tokenizer, self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{name} has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len}")
        return ids

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Drop an unfinished request between steps and free its KV blocks; -> whether it was
        found (False: unknown or already finished). ``reason``: its finish reason, "abort" or
        "stop" (a stop string the caller found in its text)."""
        self._check_single_rank("abort_request")
        if reason not in ("abort", "stop"):
            raise ValueError(f"reason={reason!r}: allowed 'abort', 'stop'")
        return self.core.abort(request_id, reason)

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (async scheduling) a step not yet read."""
        return self.core.has_unfinished()

    def _check_single_rank(self, name: str) -> None:
        if self.launcher:
            sizes = ", ".join(f"{k}={v}" for k, v in (
                ("data_parallel_size", self.data_parallel_size),
                ("tensor_parallel_size", self.config.tensor_parallel_size)) if v > 1)
            raise RuntimeError(f"LLM.{name}() runs one rank's engine; with {sizes} use "
                               "generate()")
        if self.tp.rank > 0:
            raise RuntimeError(f"LLM.{name}(): this process is TP rank {self.tp.rank}, which "
                               "runs its TP rank 0's steps: call serve()")

    def serve(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """A TP peer (rank > 0): run the driver's steps until every DP rank is idle; -> the
        collectives of each step."""
        if self.tp.rank == 0:
            raise RuntimeError("LLM.serve() runs on TP ranks > 0; TP rank 0 calls step()")
        return self.core.serve()

    def step(self) -> StepRecord | None:
        """Run one engine step (``EngineCore.step``); None once every DP rank is out of
        work."""
        self._check_single_rank("step")
        return self.core.step()

    def generate(self, prompts,
                 sampling_params: "SamplingParams | list[SamplingParams] | None" = None, *,
                 max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, ignore_eos: bool | None = None,
                 stop_token_ids: list[int] | None = None, seed: int | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. ``prompts``: a str, a list of token ids or a
        vLLM prompt dict (``{"prompt": str}``, ``{"prompt_token_ids": [...]}``) is one
        prompt; or a list of those. ``sampling_params`` (as vLLM's ``LLM.generate``): one
        SamplingParams for every prompt, or a list with one per prompt; or give the keyword
        arguments instead (unset ones take SamplingParams' defaults: max_tokens 64, greedy).
        An int in its place is read as ``max_tokens`` (the older positional form). Every prompt
        is checked before any is queued; if the call fails or is interrupted, none of its
        requests stays queued. ``seed``: every prompt's random numbers are keyed by it (see
        SamplingParams.seed and engine/counter_rng.py)."""
        prompts = as_prompt_list(prompts)
        per_prompt = sampling_params_per_prompt(len(prompts), sampling_params, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids, seed=seed))
        per_prompt = [self._check_params(params, f"sampling_params[{i}]")
                      for i, params in enumerate(per_prompt)]
        ids = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        texts = [p.get("prompt") if isinstance(p, dict) else p if isinstance(p, str) else None
                 for p in prompts]
        return self._generate(ids, per_prompt, texts)

    def _generate(self, ids: list[list[int]], per_prompt: list[SamplingParams],
                  texts: list[str | None]) -> list[RequestOutput]:
        """Run checked prompts (token ids) to the end, n samples each (``parallel_sampling``);
        ``texts``: each one's prompt text for ``RequestOutput.prompt`` (None: given as ids)."""
        ids, per_prompt, texts, counts = fan_out(ids, per_prompt, texts)
        return fan_in(self._run(ids, per_prompt, texts), counts)

    def _run(self, ids: list[list[int]], per_prompt: list[SamplingParams],
             texts: list[str | None]) -> list[RequestOutput]:
        """One request per prompt, run to the end (here, or across the ranks)."""
        if self.launcher or self.role.torchrun:
            # the ids one rank would give (its running count): an unseeded sampled request's
            # random numbers are keyed by its id, so the ranks draw the numbers one rank would
            first, self._next_id = self._next_id, self._next_id + len(ids)
            outs = generate_across_ranks(self, ids, per_prompt,
                                         [str(first + i) for i in range(len(ids))])
            for out, text in zip(outs, texts):
                out.prompt = text
            return outs
        reqs = [self._queue(x, params, None) for x, params in zip(ids, per_prompt)]
        try:
            while self.step() is not None:
                pass
        except BaseException:
            for r in reqs:
                self.scheduler.abort(r, "abort")
            raise
        return [RequestOutput.of(r, self.tokenizer, text) for r, text in zip(reqs, texts)]

    def chat(self, messages, sampling_params: "SamplingParams | list | None" = None, *,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or
        a list of them -> one RequestOutput per conversation, in order. Each is rendered with
        the model folder's chat template exactly as ``specdec serve`` renders it
        (``engine/chat_template.py``; "developer" as "system"), tokenized without adding
        special tokens (the template writes them), then generated as ``generate`` does
        (``sampling_params``: one SamplingParams, one per conversation, or None: the
        defaults). ``out.prompt`` is the rendered text."""
        if self.tokenizer is None:
            raise TypeError("chat() needs the model's tokenizer.json; pass token ids to "
                            "generate()")
        check_bool("add_generation_prompt", add_generation_prompt)
        one = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, dict) for m in messages)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError(f"messages={messages!r}: must be a conversation (a list of "
                            "{'role', 'content'} dicts) or a non-empty list of them")
        if self._chat_render is None:  # the folder the server's template comes from
            self._chat_render = chat_template.load_chat_template(
                self.init_kwargs.get("model") or DEFAULT_MODEL)
        names = ["messages"] if one else [f"messages[{i}]" for i in range(len(conversations))]
        texts = [self._chat_render(chat_template.template_messages(name, conv),
                                   add_generation_prompt=add_generation_prompt)
                 for name, conv in zip(names, conversations)]
        per_prompt = sampling_params_per_prompt(len(texts), sampling_params, {})
        per_prompt = [self._check_params(params, f"sampling_params[{i}]")
                      for i, params in enumerate(per_prompt)]
        ids = [self._prompt_ids(self.tokenizer.encode(text, add_special_tokens=False).ids,
                                name) for name, text in zip(names, texts)]
        return self._generate(ids, per_prompt, texts)


def no_prefix_caching(target, drafter) -> str | None:
    """Why prefix caching cannot run with this target and drafter class; None: it can."""
    if drafter is not None and drafter.reads_prompt_states:
        return ("method='extract_hidden_states' saves the target's hidden states at every "
                "prompt position, and a cache hit computes none of them")
    return None
