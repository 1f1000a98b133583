"""``EngineCore``: one rank's engine -- the scheduler, the runner, the drafter and the step in
flight. ``step()`` is schedule, launch (or continue the step in flight), complete, apply::

    launched = core._launch()          # schedule + plan (the DP all-reduce) + device work
    core._continue(launched)           # async scheduling: the next decode queued behind it
    core._complete(launched)           # the step's one host read, results applied

``LLM`` (engine/llm.py) is the front: it checks arguments, loads the models and queues
requests; the API server's engine process drives the same core through ``LLM``.
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.distributed import TPContext
from specdec.dp import DPContext
from specdec.draft_tree import DynamicTree, HostTree, node_shapes
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.config import EngineConfig
from specdec.engine.k_policy import GoodputPolicy
from specdec.engine.outputs import STEP_GRAPHS, StepRecord
from specdec.engine.rejection_sampler import valid_tokens
from specdec.engine.runner import ModelRunner, StepBatch
from specdec.engine.scheduler import ScheduledRequest, Scheduler, is_uniform_decode
from specdec.engine.sequence import Request, SamplingParams, Status
from specdec.engine.text_stream import TextStream
from specdec.graphs import Backend
from specdec.linear_state import has_linear_attention
from specdec.models.layers.linear import use_cpu_gemm_layout
from specdec.padding import BatchPadder, StepPlan, StepSizes
from specdec.proposers.factory import build_proposer
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


class EngineCore:
    """One rank's scheduler, proposer and runner over a checked target and head (``LLM``
    checked them), sized once (``StepSizes``); construction captures / compiles the step
    graphs. ``steps``: a StepRecord per step run."""

    def __init__(self, cfg: EngineConfig, spec, target, head, *, backend: Backend,
                 dp: DPContext, tp: TPContext,
                 check_host_syncs: bool | None = None, async_scheduling: bool = False,
                 tokenizer=None):
        self.spec, self.target, self.backend, self.dp, self.tp = spec, target, backend, dp, tp
        self.tokenizer = tokenizer  # stop strings are matched on the decoded output
        self.device = cfg.device
        self.max_model_len = cfg.max_model_len
        self.eos_token_ids = frozenset(target.config.eos_token_ids)
        if check_host_syncs is None:
            check_host_syncs = os.environ.get(CHECK_HOST_SYNCS_ENV, "0") == "1"
        self.check_host_syncs = check_host_syncs
        self.padded = spec is None or spec.is_padded
        self.async_scheduling = async_scheduling
        if tp.record is None:
            tp.record = dp.record
        # K of the step: the drafts a decode feeds (a tree's nodes past its root)
        k = spec.num_fed_drafts if spec else 0
        self.tree = spec.tree if spec else None
        self.padder = BatchPadder(cfg.capture_sizes, cfg.tensor_parallel_size,
                                  cfg.sequence_parallel)
        sizes = StepSizes.of(self.padder, k, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                             cfg.max_model_len)
        num_blocks = cfg.num_kv_blocks
        self.proposer, aux_ids = (None, ()) if spec is None else build_proposer(
            spec, target, head, sizes, block_size=cfg.block_size, num_kv_blocks=num_blocks,
            dtype=cfg.dtype, device=self.device, backend=backend)
        cfg.resolve_pack_prefill(self.proposer is not None and self.proposer.drafts_on_device)
        # linear attention: a cached prefix needs a snapshot of the state after it
        snapshots = (cfg.max_num_seqs if cfg.enable_prefix_caching
                     and has_linear_attention(target) else 0)
        # a cached block's key reads the tokens after it that the drafter's KV depends on
        self.allocator = BlockAllocator(
            num_blocks, cfg.block_size, caching=cfg.enable_prefix_caching,
            lookahead=getattr(self.proposer, "cache_lookahead", 0), snapshots=snapshots)
        self._warming_up = False  # throwaway requests run (no drafter keeps anything of them)
        # a padded batch whose uniform decodes run a captured or compiled step feeds every
        # decode 1 + K tokens (filler after fewer drafts: the step keeps its shape); eager
        # and compile_dynamic steps take any shape, so no filler is computed there
        self.scheduler = Scheduler(
            cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, self.allocator,
            num_speculative_tokens=k, fill_drafts=self.padded and backend.fixed_shapes,
            pick_k=self._pick_k(k), reserve_ahead=1 + k if async_scheduling else 0,
            draft_rows=self._draft_rows(k), pack_prefill=cfg.pack_prefill,
            on_finish=None if self.proposer is None else self._on_finish)
        use_cpu_gemm_layout(target, head)  # before graph capture / compilation
        self.runner = ModelRunner(
            target, self.proposer, sizes, block_size=cfg.block_size, num_kv_blocks=num_blocks,
            aux_layer_ids=aux_ids, padder=self.padder, dp=dp, device=self.device,
            dtype=cfg.dtype, backend=backend, seed=cfg.seed, tp=tp, state_snapshots=snapshots,
            step_ks=(k,) if self.tree is not None else spec.step_ks if spec else None,
            tree=self.tree)
        self._in_flight: Launched | None = None  # async: a step launched, not yet read
        self._completing: list[ScheduledRequest] = []  # the step whose results are applied
        self.steps: list[StepRecord] = []
        self.graph_warmup_seconds = self.runner.warm_up_graphs()  # compile/capture, untimed
        self._graphs_at_last_step = self._count_graphs()  # start-up's graphs are not counted
        if tp.size > 1:  # no step (nor file) before every TP rank has checked its config
            dist.barrier(group=tp.group)
        if backend.dynamic and dp.size == 1:
            self.graph_warmup_seconds += self._warm_up_code_paths()

    def _draft_rows(self, k: int) -> int:
        """The drafter's K/V rows past a step's tokens: K (a chain's draft loop), a tree's
        depth and head rows, or none for a host drafter (ngram, suffix: no draft model; its
        drafts take KV slots only when a step verifies them)."""
        if self.proposer is None or not self.proposer.drafts_on_device:
            return 0
        return k if self.tree is None else self.tree.max_depth + self.tree.head_rows

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

    def _on_finish(self, r: Request) -> None:
        """A running request ended (any reason): its drafter may keep its tokens."""
        self.proposer.on_finish(r, keep=not self._warming_up)

    @property
    def startup(self) -> str | None:
        """What start-up spent on step graphs, e.g. ``"cuda_graph: 6 step graphs captured in
        1.9 s"``; None when none were captured or compiled then (eager)."""
        if self.graph_warmup_seconds == 0:
            return None
        seconds = f"{self.graph_warmup_seconds:.1f} s"
        if self.backend.dynamic:
            return f"{self.backend.name}: step code paths compiled in {seconds}"
        graphs = [self.runner.target_graph, getattr(self.proposer, "step_graph", None)]
        n = sum(len(g.captured) for g in graphs if g is not None)
        return f"{self.backend.name}: {n} step graphs captured in {seconds}"

    def _warm_up_code_paths(self) -> float:
        """compile_dynamic: compile the step's code paths that serving meets, for each
        sampling variant, on throwaway requests before the first real one (``warmup_phases``);
        a DP rank's paths compile at their first use. -> seconds spent."""
        start, self._warming_up = time.perf_counter(), True
        # the phases repeat their prompts: hits would skip the step shapes they are made of
        caching, self.allocator.caching = self.allocator.caching, False
        # an eager forward first (an idle DP rank's): what a layer keeps from its first eager
        # call (the rotary tables) is then there for every compile, so no later eager call (a
        # ragged draft, another engine in this process) fails the graphs' guards
        self.runner.dummy_run(StepPlan(0, 0, 1, 1, False, (1,)))
        longest = max(1, self.max_model_len - 5)
        phases = warmup_phases(self.scheduler.max_num_seqs,
                               self.scheduler.max_num_batched_tokens)
        vocab_size = self.target.config.vocab_size
        made = 0
        try:
            for sampling in WARMUP_SAMPLING:
                params = SamplingParams(max_tokens=4, ignore_eos=True, **sampling)
                for phase in phases:
                    for arrivals in phase:
                        for n in arrivals:
                            ids = [i % vocab_size for i in range(1, min(n, longest) + 1)]
                            self.add(Request(f"warm-up-{made}", ids, len(ids), params))
                            made += 1
                        self.step()
                    while self.scheduler.has_unfinished():
                        self.step()
        finally:
            self._warming_up, self.allocator.caching = False, caching
        self.steps.clear()
        return time.perf_counter() - start

    def _count_graphs(self) -> tuple[int, ...]:
        """Graphs made so far by each step graph (``STEP_GRAPHS``: the target step's, the
        draft step's; 0 where there is none)."""
        draft = getattr(self.proposer, "step_graph", None)
        return self.runner.target_graph.graphs, draft.graphs if draft is not None else 0

    def _new_graphs(self) -> dict[str, int]:
        """Graphs each step graph compiled or captured since the last call (a few ints)."""
        counts, last = self._count_graphs(), self._graphs_at_last_step
        self._graphs_at_last_step = counts
        return {name: now - before for name, now, before in zip(STEP_GRAPHS, counts, last)
                if now != before}

    # ---- requests ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a checked request (``LLM.add_request`` checks and numbers it)."""
        self.scheduler.add(request)

    def abort(self, request_id: str, reason: str) -> bool:
        """Drop the unfinished request with that id; -> whether there was one."""
        return self.scheduler.abort_by_id(request_id, reason) is not None

    def unfinished_ids(self) -> set[str]:
        return {r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)}

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or (async scheduling) a step not yet read."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop ------------------------------------------------------------------------
    def serve(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """A TP peer: run the driver's steps until every DP rank is idle; -> the collectives
        of each step."""
        if not self.check_host_syncs:
            return self.runner.serve()
        return self.runner.serve(forbid_host_sync if self.padded else count_host_syncs)

    def step(self) -> StepRecord | None:
        """Run one engine step; None once every DP rank is out of work.

        A request whose result cannot be applied (``_update``) is finished with reason
        "error". If the step itself raises (a device fault, Ctrl-C), the requests it had
        scheduled are finished with reason "error" (blocks and rows freed, ``error`` says why)
        and the exception propagates; the engine stays usable and every other request goes
        on."""
        try:
            launched, self._in_flight = self._in_flight or self._launch(), None
            if not isinstance(launched, Launched):  # no work, or an idle DP rank's step
                return launched
            if self.async_scheduling and self._can_continue(launched):
                self._in_flight = self._continue(launched)
            return self._complete(launched)
        except BaseException as e:
            in_flight, self._in_flight = self._in_flight, None
            for s in (self.scheduler.scheduled + self._completing
                      + (in_flight.scheduled if in_flight else [])):
                if s.request.status != Status.FINISHED:
                    s.request.error = f"{type(e).__name__}: {e}"
                    self.scheduler.abort(s.request, "error")
            raise
        finally:
            self._completing = []

    def _launch(self) -> "Launched | StepRecord | None":
        """Schedule, plan and launch one step (device work queued, nothing read back)."""
        start, ncoll = time.perf_counter(), len(self.dp.collectives)
        scheduled = self.scheduler.schedule()
        self._copy_states()
        for s in scheduled:
            # first chunk (after the prefix the cache held): the prompt joins the table
            if s.request.num_computed_tokens == s.request.num_cached_tokens:
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
        return self._execute(Launched(scheduled, batch, start, ncoll,
                                      cache=(self.scheduler.cache_queries,
                                             self.scheduler.cache_hits)))

    def _copy_states(self) -> None:
        """The prefix cache's state saves and restores due before the next forward."""
        saves, restores = self.scheduler.take_state_copies()
        try:
            self.runner.copy_states(saves, restores)
        except BaseException:  # a snapshot whose save may not have run holds no state
            self.allocator.drop_snapshots([snapshot for _, snapshot in saves])
            raise

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
        K, no log-probabilities asked, room for one more decode in max_model_len). At K = 0 a
        prefill chunk cut to 1 token looks like a decode, but samples nothing to continue; a
        step whose drafts were padded with filler (K rose since they were made) reads its
        logits at other rows than a step of K real drafts, which ``advance_decode`` keeps."""
        sch, k = self.scheduler, launched.batch.plan.num_spec_tokens
        if (not is_uniform_decode(launched.scheduled, k)
                or any(s.is_discarded or s.num_filler for s in launched.scheduled)
                or self._warming_up
                or len(launched.scheduled) != len(sch.running)
                or (sch.waiting and sch.free_rows) or sch.pick_step_k() != k):
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
        self._copy_states()  # the snapshots of the step before ``launched``
        nxt = Launched(scheduled, batch, time.perf_counter(), len(self.dp.collectives),
                       overlapped=True)
        return self._execute(nxt)

    def _complete(self, launched: "Launched") -> StepRecord:
        """The step's one host read, then its results applied to each request."""
        scheduled, plan = launched.scheduled, launched.batch.plan
        self._completing = scheduled
        sampled, drafts = launched.sampled, launched.drafts
        if launched.copied is not None:  # async on CUDA: its outputs' copy to the host
            launched.copied.synchronize()
        width = sampled.shape[1]  # the step's one host read (after the drafter was launched)
        rows = (sampled if drafts is None else torch.cat([sampled, drafts], dim=1)).tolist()
        sampled, drafts = [r[:width] for r in rows], [r[width:] for r in rows]
        logprobs = self.runner.step_logprobs(scheduled, sampled)
        # the policy's decodes, read before the step's tokens are applied
        decoding = ([not s.request.is_prefilling for s in scheduled]
                    if self.k_policy is not None else [])
        new_tokens = {}
        # linear attention: the step staged each row's state after the last block boundary
        # its tokens crossed. Async: the next step, already launched, runs before the save,
        # so the staged state is usable only if that step's ``after`` tokens, from this
        # one's accepted end, cross no boundary (it then stages nothing in the row); and
        # the blocks are registered now, so that within a chain of continued steps the save
        # runs before the step after that one.
        bs, snapshots = self.allocator.block_size, self.allocator.snapshots
        successor = ({id(s.request): s.num_tokens for s in self._in_flight.scheduled}
                     if self._in_flight is not None else {})
        for i, (s, row, draft) in enumerate(zip(scheduled, sampled, drafts)):
            r = s.request
            if r.status == Status.FINISHED:  # async: it ended at the step before
                continue
            if snapshots:
                start = r.num_computed_tokens
                boundary = (start + s.num_tokens) // bs * bs
                kept = start < boundary
                if after := successor.get(id(r)):  # the next step's tokens start at ``end``
                    end = start + s.num_computed(len(valid_tokens(row)) - 1)
                    kept &= (end + after) // bs * bs <= end
                r.snapshot_at = boundary if kept else None
            new_tokens[r.request_id] = self._update(s, row, draft, logprobs.get(i))
            if successor and r.status == Status.RUNNING:
                self.scheduler.register(r)
        if self._in_flight is not None:  # the next step verifies the drafts just read
            for s in self._in_flight.scheduled:
                s.spec_token_ids = list(s.request.spec_token_ids)
        rec = StepRecord(len(scheduled), plan.num_tokens, time.perf_counter() - launched.start,
                         launched.draft_seconds, launched.host_syncs,
                         len(self.dp.collectives) - launched.ncoll, new_tokens,
                         plan.capturable, self._new_graphs(), plan.num_spec_tokens,
                         launched.overlapped, *launched.cache)
        if self.k_policy is not None and not self._warming_up:
            self.k_policy.observe(len(scheduled), plan.num_spec_tokens,
                                  rec.seconds if all(decoding) else None,
                                  [len(valid_tokens(row)) - 1
                                   for row, d in zip(sampled, decoding) if d],
                                  min(self._previous_k, plan.num_spec_tokens))
            self._previous_k = plan.num_spec_tokens  # the K of the next step's drafts
        self.steps.append(rec)
        return rec

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
        r.num_computed_tokens += s.num_computed(accepted)
        if was_prefilling and self.proposer is not None and not self._warming_up:
            self.proposer.on_prefill_done(r)
        emitted, reason = 0, None
        for tok in valid:
            r.token_ids.append(tok)
            if logprobs is not None:
                r.logprobs.append(logprobs[emitted])
            emitted += 1
            if reason := self._finish_reason(r, tok):
                break
        if r.params.stop and emitted:
            dropped = self._stop_string(r, emitted, stop_token=reason in ("eos", "stop"))
            if dropped is not None:
                emitted, reason = emitted - dropped, "stop"
        if d:  # an accepted draft counts once the request kept it (not past its end)
            r.num_steps_decoding += 1
            depth = d if self.tree is None else max(node_shapes([-1, *r.spec_parents[:d]])[0])
            while len(r.num_drafted) < depth:
                r.num_drafted.append(0)
                r.num_accepted.append(0)
            for j in range(depth):
                r.num_drafted[j] += 1
                r.num_accepted[j] += j < min(accepted, emitted)
        if reason:
            self.scheduler.finish(r, reason)
            return emitted
        # the drafts the next step verifies, at this step's K (the next step's while the batch
        # size holds; 0: no search): the device's, or a host drafter's from the tokens
        r.spec_token_ids = ([] if self.proposer is None else
                            self.proposer.next_drafts(r, draft, self.scheduler.step_k))
        if isinstance(self.tree, (DynamicTree, HostTree)):  # the drafts, then their parents
            n = len(r.spec_token_ids) // 2
            r.spec_token_ids, r.spec_parents = r.spec_token_ids[:n], r.spec_token_ids[n:]
        elif self.tree is not None:
            r.spec_parents = list(self.tree.parent[1:])
        return emitted

    def _stop_string(self, r: Request, emitted: int, stop_token: bool) -> int | None:
        """Match ``r.params.stop`` on the text of the output with its last ``emitted`` tokens
        (``TextStream``, incremental; ``stop_token``: the last one ended the request, and as
        vLLM its text is not searched); at a match drop the tokens after the one completing
        it (and their log-probs) and note the string (``r.stop_reason``, the stream's cut
        text) -> tokens dropped; None: no match."""
        if r.text_stream is None:
            r.text_stream = TextStream(self.tokenizer, list(r.params.stop),
                                       r.params.include_stop_str_in_output,
                                       r.params.min_tokens)
        stream = r.text_stream
        stream.add(r.token_ids[len(r.token_ids) - emitted:], final=False, stop_token=stop_token)
        if not stream.stopped:
            return None
        dropped = len(r.output_token_ids) - len(stream.token_ids)
        del r.token_ids[len(r.token_ids) - dropped:]
        if r.logprobs is not None:
            del r.logprobs[len(r.logprobs) - dropped:]
        r.stop_reason = stream.stop_str
        return dropped

    def _finish_reason(self, r: Request, tok: int) -> str | None:
        p = r.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "eos"
        if tok in p.stop_token_ids:
            return "stop"
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None


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
    cache: tuple[int, int] = (0, 0)  # its schedule's prefix-cache (tokens queried, hit)

