"""``specdec.LLM``: load a target (+ draft head), run continuous batching with speculation."""

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from specdec.checks import check_bool
from specdec.distributed import TPContext
from specdec.dp import DPContext
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.config import EngineConfig
from specdec.engine.dp_engine import (exit_if_a_rank_reran_the_script,
                                      generate_across_ranks, parallel_role)
from specdec.engine.inputs import DEFAULT_MODEL  # noqa: F401 (re-exported)
from specdec.engine.inputs import (as_prompt_list, encode_prompt, load_target,
                                   parse_speculative_config)
from specdec.engine.k_policy import GoodputPolicy
from specdec.engine.logprobs import token_logprobs
from specdec.engine.outputs import STEP_GRAPHS, RequestOutput, StepRecord
from specdec.engine.runner import ModelRunner, StepBatch, check_tp_backend
from specdec.engine.scheduler import ScheduledRequest, Scheduler
from specdec.engine.sequence import Request, SamplingParams, Status
from specdec.graphs import COMPILING, SHAPE_FREE_BACKENDS, resolve_backend
from specdec.models.heads import SharedWeights
from specdec.models.layers.linear import use_cpu_gemm_layout
from specdec.models.layers.moe import has_cross_rank_layers
from specdec.models.layers.parallel import check_shardable
from specdec.padding import BatchPadder, StepPlan, StepSizes
from specdec.proposers.factory import build_proposer, load_checked_head
from specdec.syncs import count_host_syncs, forbid_host_sync

CHECK_HOST_SYNCS_ENV = "SPECDEC_CHECK_HOST_SYNCS"  # "1": check every step (the tests set it)


# compile_dynamic's warm-up, run once per sampling variant (WARMUP_SAMPLING) before the first
# real request: phases of arrivals (prompt lengths added before each step; each phase then runs
# to the end). Dynamo specializes a size of 1 and guards each branch of the torch paged
# attention's row layout (``row_shape``), so each step shape below is a graph of its own (the
# attention bound is at least 2, so a sequence length of 1 is not): a 1-token prompt alone
# (N = 1) and its decodes; a longer prompt alone; two 1-token prompts (N = 2: token-major
# rows) and their decodes; two equal prompts (request-major rows); a chunk among
# decodes (segments); max_num_seqs - 1 one-token prompts with a 5-token one (token-major rows
# though a request has several tokens); a prompt one token past the step budget, whose 1-token
# last chunk runs alone, then beside a 1-token prompt (seq_len > 1).
def warmup_phases(max_num_seqs: int, max_num_batched_tokens: int) -> tuple:
    """compile_dynamic's warm-up phases (above) for these sizes: steps of prompt lengths."""
    chunked = max_num_batched_tokens + 1
    return (((1,),), ((8,),), ((1, 1),), ((6, 6),), ((6, 6, 6), (), (17,)),
            ((1,) * (max_num_seqs - 1) + (5,),), ((chunked,),), ((chunked,), (1,)))


WARMUP_SAMPLING = ({}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.5})


class LLM:
    def __init__(self, model: str | Path | None = None, speculative_config=None, *,
                 max_model_len: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 256, block_size: int = 16,
                 dtype: str | torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                 capture_sizes: list[int] | None = None, tensor_parallel_size: int = 1,
                 sequence_parallel: bool = False, dp: DPContext | None = None,
                 data_parallel_size: int = 1, data_parallel_timeout: float = 600.0,
                 tp: TPContext | None = None,
                 target=None, draft_head=None, tokenizer=None,
                 graph_backend: str | None = None, compile_backend: str | None = None,
                 check_host_syncs: bool | None = None, async_scheduling: bool = False):
        """Check everything (on a launcher too, before any rank starts), then build this
        rank's engine; a launcher (data_parallel_size or tensor_parallel_size > 1, no
        dp/tp given) builds none: ``generate`` spawns the ranks (``dp_engine``)."""
        # what each rank is built from (specdec.engine.dp_engine)
        self.init_kwargs = {k: v for k, v in locals().items() if k not in (
            "self", "dp", "tp", "data_parallel_size", "data_parallel_timeout")}
        cfg = self.config = EngineConfig(
            max_model_len, max_num_seqs, max_num_batched_tokens, block_size, dtype, device,
            seed, capture_sizes, tensor_parallel_size, sequence_parallel, data_parallel_size,
            data_parallel_timeout)
        self.role = parallel_role(cfg, dp, tp)
        self.launcher, self.tp, self.device = self.role.launcher, self.role.tp, cfg.device
        if self.launcher:
            exit_if_a_rank_reran_the_script()  # before loading anything
        self.data_parallel_size = data_parallel_size
        self.spec = parse_speculative_config(speculative_config)
        # a launcher checks on a host copy; only the ranks put weights on the accelerator
        load_on = torch.device("cpu") if self.launcher else cfg.device
        target, self.tokenizer, model = load_target(model, target, tokenizer, cfg.dtype,
                                                    load_on, tp=self.tp)
        cfg.check_model(target.config)
        k = self.spec.num_speculative_tokens if self.spec else 0
        cfg.check_num_speculative_tokens(k)
        if self.spec is not None and self.spec.method == "draft_model" \
                and tensor_parallel_size > 1:
            raise ValueError(f"method='draft_model' with tensor_parallel_size="
                             f"{tensor_parallel_size}: not supported yet; allowed: 1 (data "
                             "parallelism is)")
        self.target = target.eval()
        self.max_model_len = cfg.max_model_len
        self.vocab_size = target.config.vocab_size
        self.eos_token_ids = frozenset(target.config.eos_token_ids)
        head = None
        if self.spec is not None:
            if draft_head is not None and self.tp.size > 1:  # heads are replicated; they
                # share the target's sharded embedding and lm_head
                draft_head.shared = SharedWeights(target.model.embed_tokens, target.lm_head)
            head = load_checked_head(self.spec, target, model_dir=model, draft_head=draft_head,
                                     dtype=cfg.dtype, device=load_on, tokenizer=self.tokenizer)
        cfg.check_memory(target.kv_cache_spec() + ([] if head is None else head.kv_cache_spec()),
                         state_slots=1 + k)
        dp_size = self.role.dp.size if self.role.dp is not None else data_parallel_size
        self.graph_backend = resolve_backend(
            self.spec.graph_mode if self.spec else None, graph_backend, self.device,
            tensor_parallel_size=tensor_parallel_size,
            cross_rank=dp_size > 1 and any(has_cross_rank_layers(m) for m in (target, head)
                                           if m is not None))
        if compile_backend is not None and self.graph_backend not in COMPILING:
            raise ValueError(f"compile_backend={compile_backend!r} is for a compiling graph "
                             f"backend ({', '.join(COMPILING)}); this engine's is "
                             f"{self.graph_backend!r} (graph_backend, or speculative_config "
                             "graph_mode 'torchair')")
        compile_backend = compile_backend or "inductor"
        if check_host_syncs is None:
            check_host_syncs = os.environ.get(CHECK_HOST_SYNCS_ENV, "0") == "1"
        self.check_host_syncs = check_bool("check_host_syncs", check_host_syncs)
        self.padded = self.spec is None or self.spec.is_padded
        self.async_scheduling = check_bool("async_scheduling", async_scheduling)
        if self.async_scheduling:
            self._check_async(tensor_parallel_size, dp_size)
        self._in_flight: Launched | None = None  # async: a step launched, not yet read
        self.steps: list[StepRecord] = []
        self._warming_up = False  # throwaway requests run (extract_hidden_states writes no file)
        self._next_id = 0  # the next request id the engine gives
        self._ids_given = False  # add_request had a number as a caller's request_id
        self.graph_warmup_seconds = 0.0
        if self.launcher:  # refused here, before any rank starts
            check_shardable(target, tensor_parallel_size)
            check_tp_backend(TPContext(0, tensor_parallel_size), self.graph_backend)
            return
        self._build_engine(head, model, k, compile_backend)

    def _check_async(self, tensor_parallel_size: int, dp_size: int) -> None:
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
        if spec is not None and (spec.drafts_on_host or not spec.is_padded
                                 or spec.method == "extract_hidden_states"):
            what = ("disable_padded_drafter_batch=True" if not spec.is_padded
                    else f"method={spec.method!r}")
            raise ValueError(f"async_scheduling=True with {what}: the next step's inputs must "
                             "come from the device (a padded head or draft model); allowed: "
                             "methods mtp, eagle, eagle3, draft_model, padded, or none")

    def _build_engine(self, head, model: Path | None, k: int, compile_backend: str) -> None:
        """This rank's scheduler, proposer and runner over the checked target and head, sized
        once (``StepSizes``); then capture / compile the step graphs."""
        cfg = self.config
        self.dp = self.role.dp or DPContext()
        if self.tp.record is None:
            self.tp.record = self.dp.record
        self.padder = BatchPadder(cfg.capture_sizes, cfg.tensor_parallel_size,
                                  cfg.sequence_parallel)
        sizes = StepSizes.of(self.padder, k, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                             cfg.max_model_len)
        num_blocks = cfg.num_kv_blocks
        self.allocator = BlockAllocator(num_blocks, cfg.block_size)
        # a padded batch whose uniform decodes run a captured or compiled step feeds every
        # decode 1 + K tokens (filler after fewer drafts: the step keeps its shape); eager
        # and compile_dynamic steps take any shape, so no filler is computed there
        fill = self.padded and self.graph_backend not in SHAPE_FREE_BACKENDS
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.max_model_len, self.allocator, num_speculative_tokens=k,
                                   fill_drafts=fill, pick_k=self._pick_k(k),
                                   reserve_ahead=1 + k if self.async_scheduling else 0)
        proposer, aux_ids = None, ()
        if self.spec is not None:
            proposer, aux_ids = build_proposer(
                self.spec, self.target, head, sizes, block_size=cfg.block_size,
                num_kv_blocks=num_blocks, dtype=cfg.dtype, device=self.device,
                graph_backend=self.graph_backend, compile_backend=compile_backend)
        # ngram / suffix draft on the host from each request's tokens (``_apply``; suffix
        # caches what ends); the runner runs the target step alone for them
        self.host_drafter = proposer if self.spec is not None and self.spec.drafts_on_host \
            else None
        if self.host_drafter is not None:
            proposer = None
            self.scheduler.on_finish = lambda r: self.host_drafter.finish(
                r.request_id, r.token_ids, keep=not self._warming_up)
        use_cpu_gemm_layout(self.target, head)  # before graph capture / compilation
        self.runner = ModelRunner(
            self.target, proposer, sizes, block_size=cfg.block_size, num_kv_blocks=num_blocks,
            aux_layer_ids=aux_ids, padder=self.padder, dp=self.dp, device=self.device,
            dtype=cfg.dtype, graph_backend=self.graph_backend, compile_backend=compile_backend,
            seed=cfg.seed, tp=self.tp, step_ks=self.spec.step_ks if self.spec else None)
        self.graph_warmup_seconds = self.runner.warm_up_graphs()  # compile/capture, untimed
        self._graphs_at_last_step = self._count_graphs()  # start-up's graphs are not counted
        if self.tp.size > 1:  # no step (nor file) before every TP rank has checked its config
            dist.barrier(group=self.tp.group)
        if self.graph_backend == "compile_dynamic" and self.dp.size == 1:
            self.graph_warmup_seconds += self._warm_up_code_paths()

    def _pick_k(self, k: int):
        """The scheduler's (batch size, decode-only step) -> K: the speculative config's K
        schedule, under its policy (``self.k_policy``) if one is set; None: K every step."""
        spec, self.k_policy = self.spec, None
        if spec is None:
            return None
        if spec.num_speculative_tokens_policy == "goodput":
            self._previous_k = k
            policy = self.k_policy = GoodputPolicy(
                k, lambda n: self.padder.dispatch(n).num_tokens)
            return lambda n, decode_only: policy.pick(n, spec.k_for_batch_size(n), decode_only)
        if spec.num_speculative_tokens_per_batch_size:
            return lambda n, decode_only: spec.k_for_batch_size(n)
        return None

    @property
    def startup(self) -> str | None:
        """What start-up spent on step graphs, printed once by the commands, e.g.
        ``"cuda_graph: 6 step graphs captured in 1.9 s"``; None when none were captured or
        compiled then (eager; a DP/TP launcher, whose ranks build the engines)."""
        if self.launcher or self.graph_warmup_seconds == 0:
            return None
        seconds = f"{self.graph_warmup_seconds:.1f} s"
        if self.graph_backend == "compile_dynamic":
            return f"compile_dynamic: step code paths compiled in {seconds}"
        graphs = [self.runner.target_graph, getattr(self.runner.proposer, "step_graph", None)]
        n = sum(len(g.captured) for g in graphs if g is not None)
        return f"{self.graph_backend}: {n} step graphs captured in {seconds}"

    def _warm_up_code_paths(self) -> float:
        """compile_dynamic: compile the step's code paths that serving meets, for each
        sampling variant, on throwaway requests before the first real one (``warmup_phases``);
        a DP rank's paths compile at their first use. -> seconds spent."""
        start, self._warming_up = time.perf_counter(), True
        # an eager forward first (an idle DP rank's): what a layer keeps from its first eager
        # call (the rotary tables) is then there for every compile, so no later eager call (a
        # ragged draft, another engine in this process) fails the graphs' guards
        self.runner.dummy_run(StepPlan(0, 0, 1, 1, False, (1,)))
        longest = max(1, self.max_model_len - 5)
        phases = warmup_phases(self.scheduler.max_num_seqs,
                               self.scheduler.max_num_batched_tokens)
        try:
            for sampling in WARMUP_SAMPLING:
                params = SamplingParams(max_tokens=4, ignore_eos=True, **sampling)
                for phase in phases:
                    self._warm_up_phase(phase, params, longest)
        finally:
            self._warming_up = False
        self.steps.clear()
        self._next_id = 0
        return time.perf_counter() - start

    def _warm_up_phase(self, phase: tuple, params: SamplingParams, longest: int) -> None:
        """One warm-up phase: its arrivals before each step, then steps to the end."""
        for arrivals in phase:
            for n in arrivals:
                self._queue([i % self.vocab_size for i in range(1, min(n, longest) + 1)],
                            params, None)
            self.step()
        while self.scheduler.has_unfinished():
            self.step()

    def _count_graphs(self) -> tuple[int, ...]:
        """Graphs made so far by each step graph (``STEP_GRAPHS``: the target step's, the
        draft step's; 0 where there is none)."""
        draft = getattr(self.runner.proposer, "step_graph", None)
        return self.runner.target_graph.graphs, draft.graphs if draft is not None else 0

    def _new_graphs(self) -> dict[str, int]:
        """Graphs each step graph compiled or captured since the last call (a few ints)."""
        counts, last = self._count_graphs(), self._graphs_at_last_step
        self._graphs_at_last_step = counts
        return {name: now - before for name, now, before in zip(STEP_GRAPHS, counts, last)
                if now != before}

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
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id={request_id!r}: must be a str or None")
        if request_id is not None and request_id in self._unfinished_ids():
            raise ValueError(f"request_id={request_id!r} is taken by an unfinished request; "
                             "give another, or None (the engine numbers requests)")
        self._ids_given |= request_id is not None and request_id.isdecimal()
        return self._queue(self._prompt_ids(prompt, "prompt"), params, request_id)

    def _unfinished_ids(self) -> set[str]:
        return {r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)}

    def _check_params(self, params: SamplingParams, name: str) -> SamplingParams:
        """-> the request's own copy of ``params``, every field checked again (a field set
        after construction, ``params.max_tokens = 0``, is refused as at construction; a later
        change to the caller's object does not reach a queued request). Then what
        SamplingParams cannot check alone: stop ids in the vocabulary; prompt
        log-probabilities need a single-rank lm_head (under TP it is a collective)."""
        try:
            params = replace(params)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}.{e}") from None
        params.check_vocab(self.vocab_size)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            raise ValueError(f"{name}.prompt_logprobs={params.prompt_logprobs}: not supported "
                             f"with tensor_parallel_size={self.config.tensor_parallel_size} "
                             "(allowed: None); output logprobs are")
        return params

    def _queue(self, ids: list[int], params: SamplingParams, request_id: str | None) -> Request:
        """``request_id`` None: the next number, past any a caller's id holds (``_ids_given``:
        a caller gave a number as an id)."""
        if request_id is None:
            taken = self._unfinished_ids() if self._ids_given else ()
            while str(self._next_id) in taken:
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        req = Request(request_id, ids, len(ids), params)
        self.scheduler.add(req)
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
        return self.scheduler.abort_by_id(request_id, reason) is not None

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (async scheduling) a step not yet read."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

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
        if not self.check_host_syncs:
            return self.runner.serve()
        return self.runner.serve(forbid_host_sync if self.padded else count_host_syncs)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        """Run one engine step; None once every DP rank is out of work.

        A request whose result cannot be applied (``_update``) is finished with reason
        "error". If the step itself raises (a device fault, Ctrl-C), the requests it had
        scheduled are finished with reason "error" (blocks and rows freed, ``error`` says why)
        and the exception propagates; the engine stays usable and every other request goes
        on."""
        self._check_single_rank("step")
        try:
            return self._step()
        except BaseException as e:
            in_flight, self._in_flight = self._in_flight, None
            for s in self.scheduler.scheduled + (in_flight.scheduled if in_flight else []):
                if s.request.status != Status.FINISHED:
                    s.request.error = f"{type(e).__name__}: {e}"
                    self.scheduler.abort(s.request, "error")
            raise

    def _step(self) -> StepRecord | None:
        """Launch a step (or take the one in flight), with async scheduling launch the next
        decode behind it when it can (``_continue``), then read and apply it."""
        launched, self._in_flight = self._in_flight or self._launch(), None
        if not isinstance(launched, Launched):  # no work, or an idle DP rank's step
            return launched
        if self.async_scheduling and self._can_continue(launched):
            self._in_flight = self._continue(launched)
        return self._complete(launched)

    def _launch(self) -> "Launched | StepRecord | None":
        """Schedule, plan and launch one step (device work queued, nothing read back)."""
        start, ncoll = time.perf_counter(), len(self.dp.collectives)
        scheduled = self.scheduler.schedule()
        for s in scheduled:
            if s.request.num_computed_tokens == 0:  # first chunk: the prompt joins the table
                self.runner.write_prompt(s.request.row, s.request.token_ids)
        plan = self.runner.plan(scheduled, self.scheduler.step_k)  # the one DP all-reduce
        if plan.num_spec_tokens < self.scheduler.step_k:  # DP: another rank's K is smaller
            self.scheduler.cut_to_k(plan.num_spec_tokens)
        if plan.all_idle:
            self.runner.send_stop()  # TP peers return from serve()
            return None
        if not scheduled:  # idle DP rank: same forwards and collectives, nothing to emit
            self.runner.send_dummy(plan)
            self.runner.dummy_run(plan)
            rec = StepRecord(0, 0, time.perf_counter() - start, 0.0,
                             0 if self.check_host_syncs else None,
                             len(self.dp.collectives) - ncoll,
                             num_spec_tokens=plan.num_spec_tokens)
            self.steps.append(rec)
            return rec
        batch = self.runner.prepare(scheduled, plan)
        self.runner.send_step(batch)  # the one TP broadcast of the step's host inputs
        return self._execute(Launched(scheduled, batch, start, ncoll))

    def _execute(self, launched: "Launched") -> "Launched":
        syncs = None
        if self.check_host_syncs:  # proof machinery, only when asked (tests, a flag)
            with (forbid_host_sync() if self.padded else count_host_syncs()) as counter:
                launched.sampled, launched.drafts = self.runner.execute(launched.batch)
            syncs = 0 if self.padded else counter.count
        else:
            launched.sampled, launched.drafts = self.runner.execute(launched.batch)
        launched.host_syncs, launched.draft_seconds = syncs, self.runner.last_draft_seconds
        return launched

    def _can_continue(self, launched: "Launched") -> bool:
        """Whether the step after ``launched`` is known before its results: a uniform decode
        of every running request again (no waiting request a free row would admit, the same
        K, no log-probabilities asked, room for one more decode in max_model_len)."""
        sch, plan = self.scheduler, launched.batch.plan
        k = plan.num_spec_tokens
        uniform = all(s.num_tokens == 1 + k == 1 + len(s.spec_token_ids) + s.num_filler
                      for s in launched.scheduled)
        if (not uniform or self._warming_up or len(launched.scheduled) != len(sch.running)
                or (sch.waiting and sch.free_rows)):
            return False
        if sch.pick_k is not None and sch.pick_k(len(sch.running), True) != k:
            return False
        limit = self.max_model_len - (2 * (1 + k) + k)
        reqs = [s.request for s in launched.scheduled]
        return (all(r.num_computed_tokens <= limit and r.params.logprobs is None
                    and r.params.prompt_logprobs is None for r in reqs)
                # one request at least still runs after this step, whatever it accepts
                and any(len(r.output_token_ids) + 1 + k < r.params.max_tokens for r in reqs))

    def _continue(self, launched: "Launched") -> "Launched":
        """Launch the decode after ``launched`` from its device outputs; its host work then
        runs while this one executes. Its outputs are copied to the host first (a captured
        step's are overwritten by the next replay): on CUDA into pinned memory behind an
        event, which the host read then waits for alone (not for the step after)."""
        cuda = self.device.type == "cuda"
        outputs = [launched.sampled, launched.drafts]
        launched.sampled, launched.drafts = (
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda).copy_(
                t, non_blocking=cuda) for t in outputs)
        if cuda:
            launched.copied = torch.cuda.Event()
            launched.copied.record()
        k = launched.batch.plan.num_spec_tokens
        grown = []  # KV blocks up to this step's end + one more decode (the host lags one)
        for i, s in enumerate(launched.scheduled):
            blocks = s.request.block_ids
            have = len(blocks)
            self.scheduler.reserve(s.request, 1 + k)
            grown.append((i, have, blocks[have:]))
        self.runner.extend_block_tables(grown)
        batch = self.runner.advance_decode(launched.batch, *outputs)
        scheduled = [ScheduledRequest(s.request, 1 + k, [0] * k) for s in launched.scheduled]
        nxt = Launched(scheduled, batch, time.perf_counter(), len(self.dp.collectives),
                       overlapped=True)
        return self._execute(nxt)

    def _complete(self, launched: "Launched") -> StepRecord:
        """The step's one host read, then its results applied to each request."""
        scheduled, plan = launched.scheduled, launched.batch.plan
        self.scheduler.scheduled = scheduled
        sampled, drafts = launched.sampled, launched.drafts
        if launched.copied is not None:  # async on CUDA: its outputs' copy to the host
            launched.copied.synchronize()
        width = sampled.shape[1]  # the step's one host read (after the drafter was launched)
        rows = (sampled if drafts is None else torch.cat([sampled, drafts], dim=1)).tolist()
        sampled, drafts = [r[:width] for r in rows], [r[width:] for r in rows]
        logprobs = self._logprobs(scheduled, sampled)
        # the policy's decodes, read before the step's tokens are applied
        decoding = ([not s.request.is_prefilling for s in scheduled]
                    if self.k_policy is not None else [])
        new_tokens = {}
        for i, (s, row, draft) in enumerate(zip(scheduled, sampled, drafts)):
            if s.request.status == Status.FINISHED:  # async: it ended at the step before
                continue
            new_tokens[s.request.request_id] = self._update(s, row, draft, logprobs.get(i))
        if self._in_flight is not None:  # the next step verifies the drafts just read
            for s in self._in_flight.scheduled:
                s.spec_token_ids = list(s.request.spec_token_ids)
        rec = StepRecord(len(scheduled), plan.num_tokens, time.perf_counter() - launched.start,
                         launched.draft_seconds, launched.host_syncs,
                         len(self.dp.collectives) - launched.ncoll, new_tokens,
                         plan.capturable, self._new_graphs(), plan.num_spec_tokens,
                         launched.overlapped)
        if self.k_policy is not None and not self._warming_up:
            self.k_policy.observe(len(scheduled), plan.num_spec_tokens,
                                  rec.seconds if all(decoding) else None,
                                  [len(valid_tokens(row)) - 1
                                   for row, d in zip(sampled, decoding) if d],
                                  min(self._previous_k, plan.num_spec_tokens))
            self._previous_k = plan.num_spec_tokens  # the K of the next step's drafts
        self.steps.append(rec)
        return rec

    def _logprobs(self, scheduled, sampled: list[list[int]]) -> dict[int, list]:
        """The log-probabilities this step owes the requests that ask: batch index i ->
        TokenLogprobs of request i's valid sampled tokens (``params.logprobs``). The prompt
        tokens its prefill chunk predicts (``params.prompt_logprobs``) are filed in
        ``r.prompt_logprobs`` here. One log-softmax over every row asked for; nothing runs
        when no request asks."""
        # (row, token id, top N, batch index): rows of the step's final hidden states (prompt
        # positions) and of its logits [Bp * rows] (sampled positions)
        prompt, out = [], []
        qsl = self.runner.buffers.host["query_start_loc"]
        width = len(sampled[0]) if sampled else 0
        for i, s in enumerate(scheduled):
            r, p = s.request, s.request.params
            if p.prompt_logprobs is not None and not s.spec_token_ids:
                start, done = r.num_computed_tokens, len(r.prompt_logprobs)
                for pos in range(max(start, done - 1),
                                 min(start + s.num_tokens, r.num_prompt_tokens - 1)):
                    prompt.append((int(qsl[i]) + pos - start, r.token_ids[pos + 1],
                                   p.prompt_logprobs, i))
            if p.logprobs is not None and not s.is_discarded:
                out += [(i * width + j, tok, p.logprobs, i)
                        for j, tok in enumerate(valid_tokens(sampled[i]))]
        if not prompt and not out:
            return {}
        parts = []
        if prompt:  # the prompt positions' logits: only those the requests asked for
            rows = torch.tensor([e[0] for e in prompt], device=self.device)
            parts.append(self.target.compute_logits(self.runner.last_hidden[rows]))
        if out:
            logits = self.runner.last_logits
            rows = torch.tensor([e[0] for e in out], device=self.device)
            parts.append(logits.reshape(-1, logits.shape[-1])[rows])
        entries = prompt + out
        lps = token_logprobs(torch.cat(parts),
                             torch.tensor([e[1] for e in entries], device=self.device),
                             [e[2] for e in entries])
        for (_, _, _, i), lp in zip(prompt, lps):
            scheduled[i].request.prompt_logprobs.append(lp)
        result: dict[int, list] = {}
        for (_, _, _, i), lp in zip(out, lps[len(prompt):]):
            result.setdefault(i, []).append(lp)
        return result

    def _update(self, s, sampled: list[int], draft: list[int],
                logprobs: list | None = None) -> int:
        """``_apply`` for one request; if it raises (e.g. extract_hidden_states cannot write
        its file), that request alone is finished with reason "error" and the step goes on."""
        try:
            return self._apply(s, sampled, draft, logprobs)
        except Exception as e:
            s.request.error = f"{type(e).__name__}: {e}"
            self.scheduler.abort(s.request, "error")
            return 0

    def _apply(self, s, sampled: list[int], draft: list[int], logprobs: list | None) -> int:
        """Apply one step's result to a request (``logprobs``: its valid sampled tokens',
        when it asked); returns the number of tokens emitted."""
        r = s.request
        if s.is_discarded:  # a partial prefill chunk: its sampled token is junk
            r.num_computed_tokens += s.num_tokens
            return 0
        valid = valid_tokens(sampled)
        d = len(s.spec_token_ids)
        accepted = len(valid) - 1
        was_prefilling = r.is_prefilling
        r.num_computed_tokens += s.num_tokens - s.num_filler - (d - accepted)
        if was_prefilling and self.runner.proposer is not None and not self._warming_up:
            self.runner.proposer.on_prefill_done(r)
        emitted, reason = 0, None
        for tok in valid:
            r.token_ids.append(tok)
            if logprobs is not None:
                r.logprobs.append(logprobs[emitted])
            emitted += 1
            if reason := self._finish_reason(r, tok):
                break
        if d:  # an accepted draft counts once the request kept it (not past its end)
            r.num_steps_decoding += 1
            while len(r.num_drafted) < d:
                r.num_drafted.append(0)
                r.num_accepted.append(0)
            for j in range(d):
                r.num_drafted[j] += 1
                r.num_accepted[j] += j < min(accepted, emitted)
        if reason:
            self.scheduler.finish(r, reason)
            return emitted
        # host drafts for this step's K (the next step's while the batch size holds; 0: no
        # search)
        r.spec_token_ids = (list(draft) if self.host_drafter is None
                            else self.host_drafter.propose(r.request_id, r.token_ids,
                                                           self.scheduler.step_k))
        return emitted

    def _finish_reason(self, r: Request, tok: int) -> str | None:
        p = r.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "eos"
        if tok in p.stop_token_ids:
            return "stop"
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts,
                 sampling_params: "SamplingParams | list[SamplingParams] | None" = None, *,
                 max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, ignore_eos: bool | None = None,
                 stop_token_ids: list[int] | None = None, seed: int | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. ``prompts``: a str or a list of token ids (one
        prompt), or a list of those. ``sampling_params`` (as vLLM's ``LLM.generate``): one
        SamplingParams for every prompt, or a list with one per prompt; or give the keyword
        arguments instead (unset ones take SamplingParams' defaults: max_tokens 64, greedy).
        An int in its place is read as ``max_tokens`` (the older positional form). Every prompt
        is checked before any is queued; if the call fails or is interrupted, none of its
        requests stays queued. ``seed``: every prompt's random numbers are keyed by it (see
        SamplingParams.seed and engine/counter_rng.py)."""
        prompts = as_prompt_list(prompts)
        per_prompt = self._sampling_params(len(prompts), sampling_params, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids, seed=seed))
        per_prompt = [self._check_params(params, f"sampling_params[{i}]")
                      for i, params in enumerate(per_prompt)]
        ids = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if self.launcher or self.role.torchrun:
            # the ids one rank would give (its running count): an unseeded sampled request's
            # random numbers are keyed by its id, so the ranks draw the numbers one rank would
            first, self._next_id = self._next_id, self._next_id + len(ids)
            return generate_across_ranks(self, ids, per_prompt,
                                         [str(first + i) for i in range(len(ids))])
        reqs = [self._queue(x, params, None) for x, params in zip(ids, per_prompt)]
        try:
            while self.step() is not None:
                pass
        except BaseException:
            for r in reqs:
                self.scheduler.abort(r, "abort")
            raise
        return [RequestOutput.of(r, self.tokenizer) for r in reqs]

    @staticmethod
    def _sampling_params(n: int, sampling_params, kwargs: dict) -> list[SamplingParams]:
        """One SamplingParams per prompt from generate's arguments (see generate)."""
        given = {k: v for k, v in kwargs.items() if v is not None}
        if isinstance(sampling_params, int):  # generate(prompts, 8): the older max_tokens form
            if "max_tokens" in given:
                raise TypeError("max_tokens given twice: positionally and as a keyword")
            given["max_tokens"] = sampling_params
            sampling_params = None
        if sampling_params is None:
            return [SamplingParams(**given)] * n
        if given:
            raise TypeError(f"give sampling_params or the keyword arguments "
                            f"{sorted(given)}, not both")
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (list, tuple)):
            for i, p in enumerate(sampling_params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{i}]={p!r}: must be a SamplingParams")
            if len(sampling_params) != n:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} "
                                 "prompts: give one per prompt, or a single SamplingParams")
            return list(sampling_params)
        raise TypeError(f"sampling_params={sampling_params!r}: must be a SamplingParams, a list "
                        "of them (one per prompt), or None")


@dataclass(eq=False)
class Launched:
    """A step whose device work is queued and whose results are not read yet."""

    scheduled: list[ScheduledRequest]
    batch: StepBatch
    start: float  # perf_counter when its host work began
    ncoll: int  # DP collectives before it
    overlapped: bool = False  # launched before the previous step's results were read
    sampled: torch.Tensor | None = None  # [B, 1 + K] int32 (device)
    drafts: torch.Tensor | None = None  # [B, K] int32 (device) or None
    host_syncs: int | None = None
    draft_seconds: float = 0.0
    copied: "torch.cuda.Event | None" = None  # async on CUDA: recorded after the host copy


def valid_tokens(sampled: list[int]) -> list[int]:
    """A request's row of sampled token ids up to its first placeholder (-1)."""
    return sampled[:next((i for i, t in enumerate(sampled) if t < 0), len(sampled))]
