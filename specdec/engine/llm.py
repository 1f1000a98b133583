"""``specdec.LLM``: load a target (+ draft head), run continuous batching with speculation."""

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import os

from specdec import platform
from specdec.config import SpeculativeConfig
from specdec.dp import DPContext
from specdec.engine.block_allocator import BlockAllocator
from specdec.engine.runner import ModelRunner
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Request, SamplingParams
from specdec.models.llama import LlamaForCausalLM
from specdec.graphs import resolve_backend
from specdec.padding import BatchPadder, largest_step
from specdec.proposers.factory import build_proposer
from specdec.syncs import count_host_syncs, forbid_host_sync

CHECK_HOST_SYNCS_ENV = "SPECDEC_CHECK_HOST_SYNCS"  # "1": check every step (the tests set it)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default" / "target"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str | None
    finish_reason: str
    num_drafted: list[int]  # per draft position
    num_accepted: list[int]  # per draft position
    num_decode_steps: int  # target steps that verified drafts

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verifying step: 1 + accepted / steps (1.0 = nothing accepted)."""
        return 1.0 + sum(self.num_accepted) / max(self.num_decode_steps, 1)


@dataclass
class StepRecord:
    """What one engine step cost (host wall time, seconds)."""

    num_reqs: int
    num_tokens: int
    seconds: float
    draft_seconds: float  # of which in the drafter (host wall time)
    host_syncs: int | None  # in the device part of the step; None unless syncs are checked
    collectives: int  # DP collectives issued during the step
    new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens emitted


class LLM:
    def __init__(self, model: str | Path | None = None, speculative_config=None, *,
                 max_model_len: int = 512, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 256, block_size: int = 16,
                 dtype: str | torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                 capture_sizes: list[int] | None = None, tensor_parallel_size: int = 1,
                 sequence_parallel: bool = False, dp: DPContext | None = None,
                 data_parallel_size: int = 1, target: LlamaForCausalLM | None = None,
                 draft_head=None, tokenizer=None, graph_backend: str | None = None,
                 compile_backend: str = "inductor", check_host_syncs: bool | None = None):
        # what each DP rank is built from (specdec.engine.dp_engine)
        self.init_kwargs = {k: v for k, v in locals().items()
                            if k not in ("self", "dp", "data_parallel_size")}
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size!r}: must be an int >= 1")
        if data_parallel_size > 1 and dp is not None:
            raise ValueError("pass dp=DPContext (this process is one rank) or "
                             "data_parallel_size > 1 (launch the ranks), not both")
        self.data_parallel_size = data_parallel_size
        if data_parallel_size > 1:
            return  # generate() launches the ranks; each builds its own engine
        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype={dtype!r}: allowed {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        self.device = platform.torch_device(device)
        if target is None:
            model = Path(model) if model is not None else DEFAULT_MODEL
            target = LlamaForCausalLM.load_pretrained(model, dtype=dtype, device=self.device)
            if tokenizer is None and (model / "tokenizer.json").exists():
                from tokenizers import Tokenizer
                tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.eos_token_id = target.config.eos_token_id
        self.max_model_len = max_model_len
        self.dp = dp or DPContext()
        if isinstance(speculative_config, str):
            speculative_config = SpeculativeConfig.from_json(speculative_config)
        elif isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.spec = speculative_config
        k = self.spec.num_speculative_tokens if self.spec else 0
        self.graph_backend = resolve_backend(self.spec.graph_mode if self.spec else None,
                                             graph_backend, self.device)
        if check_host_syncs is None:
            check_host_syncs = os.environ.get(CHECK_HOST_SYNCS_ENV, "0") == "1"
        if not isinstance(check_host_syncs, bool):
            raise TypeError(f"check_host_syncs={check_host_syncs!r}: must be a bool")
        self.check_host_syncs = check_host_syncs
        self.padder = BatchPadder(capture_sizes, tensor_parallel_size, sequence_parallel)
        num_blocks = max_num_seqs * -(-max_model_len // block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, max_model_len,
                                   self.allocator, num_speculative_tokens=k)
        proposer, aux_ids = None, ()
        if self.spec is not None:
            max_tokens, max_reqs = largest_step(self.padder, k, max_num_seqs,
                                                max_num_batched_tokens)
            proposer, aux_ids = build_proposer(
                self.spec, target, model_dir=model, draft_head=draft_head,
                max_num_seqs=max_reqs, max_num_tokens=max_tokens,
                block_size=block_size, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                dtype=dtype, device=self.device, graph_backend=self.graph_backend,
                compile_backend=compile_backend)
        self.runner = ModelRunner(
            target, proposer, num_speculative_tokens=k, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=num_blocks, aux_layer_ids=aux_ids,
            padder=self.padder, dp=self.dp, device=self.device, dtype=dtype,
            graph_backend=self.graph_backend, compile_backend=compile_backend, seed=seed)
        self.graph_warmup_seconds = self.runner.warm_up_graphs()  # compile/capture, untimed
        self.padded = self.spec is None or self.spec.is_padded
        self.steps: list[StepRecord] = []
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        self._check_single_rank("add_request")
        ids = self._encode(prompt)
        if len(ids) == 0:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than "
                             f"max_model_len={self.max_model_len}")
        rid = request_id if request_id is not None else str(self._next_id)
        self._next_id += 1
        req = Request(rid, list(ids), len(ids), params)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Drop an unfinished request between steps and free its KV blocks; -> whether it was
        found (False: unknown or already finished)."""
        self._check_single_rank("abort_request")
        return self.scheduler.abort(request_id) is not None

    def _check_single_rank(self, name: str) -> None:
        if self.data_parallel_size > 1:
            raise RuntimeError(f"LLM.{name}() runs one rank's engine; with data_parallel_size="
                               f"{self.data_parallel_size} use generate()")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a str but the model has no tokenizer.json; "
                                "pass token ids (list[int])")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> StepRecord | None:
        """Run one engine step; None once every DP rank is out of work."""
        self._check_single_rank("step")
        start, ncoll = time.perf_counter(), len(self.dp.collectives)
        scheduled = self.scheduler.schedule()
        for s in scheduled:
            if s.request.num_computed_tokens == 0:  # first chunk: the prompt joins the table
                self.runner.write_prompt(s.request.row, s.request.token_ids)
        plan = self.runner.plan(scheduled)  # the step's one DP all-reduce
        if plan.all_idle:
            return None
        if not scheduled:  # idle DP rank: same forwards and collectives, nothing to emit
            self.runner.dummy_run(plan)
            rec = StepRecord(0, 0, time.perf_counter() - start, 0.0,
                             0 if self.check_host_syncs else None,
                             len(self.dp.collectives) - ncoll)
            self.steps.append(rec)
            return rec
        batch = self.runner.prepare(scheduled, plan)
        syncs = None
        if self.check_host_syncs:  # proof machinery, only when asked (tests, a flag)
            with (forbid_host_sync() if self.padded else count_host_syncs()) as counter:
                sampled, drafts = self.runner.execute(batch)
            syncs = 0 if self.padded else counter.count
        else:
            sampled, drafts = self.runner.execute(batch)
        sampled = sampled.tolist()  # the step's one host read (after the drafter was launched)
        drafts = drafts.tolist() if drafts is not None else [[] for _ in scheduled]
        new_tokens = {}
        for s, row, draft in zip(scheduled, sampled, drafts):
            new_tokens[s.request.request_id] = self._update(s, row, draft)
        rec = StepRecord(len(scheduled), plan.num_tokens, time.perf_counter() - start,
                         self.runner.last_draft_seconds, syncs, len(self.dp.collectives) - ncoll,
                         new_tokens)
        self.steps.append(rec)
        return rec

    def _update(self, s, sampled: list[int], draft: list[int]) -> int:
        """Apply one step's result to a request; returns the number of tokens emitted."""
        r = s.request
        if s.is_discarded:  # a partial prefill chunk: its sampled token is junk
            r.num_computed_tokens += s.num_tokens
            return 0
        valid = sampled[:next((i for i, t in enumerate(sampled) if t < 0), len(sampled))]
        d = len(s.spec_token_ids)
        accepted = len(valid) - 1
        if d:
            r.num_steps_decoding += 1
            while len(r.num_drafted) < d:
                r.num_drafted.append(0)
                r.num_accepted.append(0)
            for j in range(d):
                r.num_drafted[j] += 1
                r.num_accepted[j] += j < accepted
        was_prefilling = r.is_prefilling
        r.num_computed_tokens += s.num_tokens - (d - accepted)
        if was_prefilling and self.runner.proposer is not None:
            self.runner.proposer.on_prefill_done(r)
        emitted = 0
        for tok in valid:
            r.token_ids.append(tok)
            emitted += 1
            reason = self._finish_reason(r, tok)
            if reason:
                self.scheduler.finish(r, reason)
                return emitted
        r.spec_token_ids = list(draft)
        return emitted

    def _finish_reason(self, r: Request, tok: int) -> str | None:
        p = r.params
        if not p.ignore_eos and tok == self.eos_token_id:
            return "eos"
        if tok in p.stop_token_ids:
            return "stop"
        if len(r.output_token_ids) >= p.max_tokens or r.num_tokens >= self.max_model_len:
            return "length"
        return None

    def generate(self, prompts, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, ignore_eos: bool = False) -> list[RequestOutput]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                ignore_eos=ignore_eos)
        if self.data_parallel_size > 1:  # N ranks, prompts split round-robin, prompt order back
            from specdec.engine.dp_engine import DPJob, run_data_parallel
            job = DPJob(self.init_kwargs, list(prompts), params)
            return run_data_parallel([job], self.data_parallel_size)[0].outputs
        reqs = [self.add_request(p, params) for p in prompts]
        while self.step() is not None:
            pass
        return [self._output(r) for r in reqs]

    def _output(self, r: Request) -> RequestOutput:
        out = r.output_token_ids
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return RequestOutput(r.request_id, r.token_ids[:r.num_prompt_tokens], out, text,
                             r.finish_reason, r.num_drafted, r.num_accepted, r.num_steps_decoding)
