"""Prometheus metrics of the server (``GET /metrics``), named like vLLM's with a ``specdec:``
prefix, and the counters vLLM has under vLLM's own names too (``vllm:``, labels ``model_name`` and
``engine``), so a vLLM dashboard reads them: ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (1 = every KV block in use),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``
(finished_reason "eos" counted as vLLM's "stop"), ``vllm:spec_decode_num_drafts_total``,
``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
``vllm:spec_decode_num_accepted_tokens_per_pos_total`` (label ``position``, 0 = the first draft),
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` (as vLLM: the prompt
tokens of requests that looked the prefix cache up when admitted, and how many of them it held;
hits / queries = the hit rate).

Per-step figures (tokens, step time, drafter time, host syncs, step graphs compiled or captured
after start-up) update after every step; the speculative counters per draft position update
when a request finishes (or is aborted), from the request's own counts, so they are exact once
a run is over.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.engine.outputs import STEP_GRAPHS

STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    """One registry per server; ``engine_gauges`` gives live gauges (running, waiting, free KV
    blocks)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_gauges, frozen_objects: int = 0, model_name: str = "",
                 num_kv_blocks: int | None = None):
        """``num_kv_blocks``: the engine's KV blocks (None: unknown, no usage gauge)."""
        r = self.registry = CollectorRegistry()
        Gauge("specdec:engine_gc_frozen_objects", "start-up objects the engine process moved "
              "out of Python's collections (gc.freeze: a full collection then scans only what "
              "serving made); 0 for an engine in the API process", registry=r).set(
            frozen_objects)
        running, waiting, free_blocks = engine_gauges
        Gauge("specdec:num_requests_running", "requests in the running batch",
              registry=r).set_function(running)
        Gauge("specdec:num_requests_waiting", "requests queued for admission",
              registry=r).set_function(waiting)
        Gauge("specdec:kv_cache_free_blocks", "free KV-cache blocks",
              registry=r).set_function(free_blocks)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "output tokens emitted",
                                         registry=r)
        self.finished = Counter("specdec:request_success", "finished requests by reason",
                                ["finished_reason"], registry=r)
        self.steps = Histogram("specdec:step_seconds", "engine step wall time (s)",
                               buckets=STEP_BUCKETS_S, registry=r)
        self.draft_seconds = Counter("specdec:step_draft_seconds", "drafter host wall time "
                                     "inside steps (s)", registry=r)
        self.captured_steps = Counter("specdec:captured_steps", "engine steps whose target "
                                      "step replayed a captured (or compiled) graph",
                                      registry=r)
        self.step_k = Counter("specdec:step_spec_tokens", "sum over engine steps of the "
                              "step's K (a K schedule's pick; / steps = the mean K)",
                              registry=r)
        self.new_graphs = Counter("specdec:graph_compiles_after_startup", "step graphs "
                                  "compiled or captured after start-up, by step graph (target, "
                                  "draft): each one stalled the running streams",
                                  ["graph"], registry=r)
        for name in STEP_GRAPHS:  # exported as 0 until one is made
            self.new_graphs.labels(name)
        self.cache_queries = Counter("specdec:prefix_cache_queries", "prompt tokens looked "
                                     "up in the prefix cache (at admission)", registry=r)
        self.cache_hits = Counter("specdec:prefix_cache_hits", "prompt tokens the prefix "
                                  "cache held", registry=r)
        self.host_syncs = Counter("specdec:host_syncs", "host-device syncs inside steps "
                                  "(counted on the ragged path; padded: 0 by construction)",
                                  registry=r)
        self.num_drafts = Counter("specdec:spec_decode_num_drafts", "verifying steps "
                                  "(request x step pairs that verified drafts)", registry=r)
        self.draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "draft tokens "
                                    "verified", registry=r)
        self.accepted_tokens = Counter("specdec:spec_decode_num_accepted_tokens",
                                       "draft tokens accepted", registry=r)
        self.draft_per_pos = Counter("specdec:spec_decode_num_draft_tokens_per_pos",
                                     "draft tokens verified per draft position", ["position"],
                                     registry=r)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted per draft position",
                                        ["position"], registry=r)
        Gauge("specdec:spec_decode_mean_acceptance_length", "1 + spec_decode_num_accepted_"
              "tokens / spec_decode_num_drafts, read from those two counters (requests that "
              "finished or were aborted since start; 1.0 before any draft)",
              registry=r).set_function(self.mean_acceptance_length)
        self._vllm_names(r, dict(model_name=model_name, engine="0"), running, waiting,
                         free_blocks, num_kv_blocks)

    def _vllm_names(self, r, labels: dict, running, waiting, free_blocks, num_kv_blocks):
        """The counters vLLM has, under its names (see the module docstring)."""
        def gauge(name, doc, fn):
            Gauge(name, doc, list(labels), registry=r).labels(**labels).set_function(fn)

        def counter(name, doc, extra=()):
            c = Counter(name, doc, [*labels, *extra], registry=r)
            return c if extra else c.labels(**labels)
        gauge("vllm:num_requests_running", "requests in the running batch", running)
        gauge("vllm:num_requests_waiting", "requests queued for admission", waiting)
        if num_kv_blocks:
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent",
                  lambda: 1.0 - free_blocks() / num_kv_blocks)
        self.vllm = dict(
            prompt_tokens=counter("vllm:prompt_tokens", "prompt tokens of finished requests"),
            generation_tokens=counter("vllm:generation_tokens", "output tokens emitted"),
            success=counter("vllm:request_success", "finished requests by reason",
                            ["finished_reason"]),
            drafts=counter("vllm:spec_decode_num_drafts", "verifying steps (request x step)"),
            draft_tokens=counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified"),
            accepted_tokens=counter("vllm:spec_decode_num_accepted_tokens",
                                    "draft tokens accepted"),
            accepted_per_pos=counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "accepted tokens per draft position", ["position"]),
            cache_queries=counter("vllm:prefix_cache_queries",
                                  "prompt tokens looked up in the prefix cache"),
            cache_hits=counter("vllm:prefix_cache_hits", "prompt tokens the prefix cache held"))
        self._vllm_labels = labels

    def mean_acceptance_length(self) -> float:
        """From the two counters themselves, so the gauge always agrees with them."""
        accepted = self.accepted_tokens._value.get()
        drafts = self.num_drafts._value.get()
        return 1.0 + accepted / drafts if drafts else 1.0

    def on_step(self, rec) -> None:
        """One engine step (a ``StepRecord``)."""
        self.steps.observe(rec.seconds)
        self.draft_seconds.inc(rec.draft_seconds)
        self.captured_steps.inc(rec.captured)
        self.step_k.inc(rec.num_spec_tokens)
        for name, n in rec.new_graphs.items():
            self.new_graphs.labels(name).inc(n)
        if rec.host_syncs is not None:  # counted only when the engine checks them
            self.host_syncs.inc(rec.host_syncs)
        self.generation_tokens.inc(sum(rec.new_tokens.values()))
        self.vllm["generation_tokens"].inc(sum(rec.new_tokens.values()))
        for name, n in (("cache_queries", rec.prefix_cache_queries),
                        ("cache_hits", rec.prefix_cache_hits)):
            getattr(self, name).inc(n)
            self.vllm[name].inc(n)

    def on_finish(self, req) -> None:
        """A request left the engine (finished or aborted): its prompt and draft counts."""
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.finished.labels(req.finish_reason or "unknown").inc()
        self.num_drafts.inc(req.num_steps_decoding)
        self.draft_tokens.inc(sum(req.num_drafted))
        self.accepted_tokens.inc(sum(req.num_accepted))
        for j, (d, a) in enumerate(zip(req.num_drafted, req.num_accepted)):
            self.draft_per_pos.labels(str(j)).inc(d)
            self.accepted_per_pos.labels(str(j)).inc(a)
        v, labels = self.vllm, self._vllm_labels
        v["prompt_tokens"].inc(req.num_prompt_tokens)
        reason = {"eos": "stop"}.get(req.finish_reason, req.finish_reason or "unknown")
        v["success"].labels(**labels, finished_reason=reason).inc()
        v["drafts"].inc(req.num_steps_decoding)
        v["draft_tokens"].inc(sum(req.num_drafted))
        v["accepted_tokens"].inc(sum(req.num_accepted))
        for j, a in enumerate(req.num_accepted):
            v["accepted_per_pos"].labels(**labels, position=str(j)).inc(a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
