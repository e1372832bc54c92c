"""Prometheus metrics of the front door (``--enable-metrics``, served on HTTP ``/metrics``).

Request counters and latency histograms are measured here, in the tokenizer process,
where every request's outputs arrive (ZMQ and HTTP clients alike), so TTFT and
inter-token latency include the scheduler, the detokenizer and the hops between them:
what a client sees, less its own network. Only streamed requests have a first token
and gaps to time (a non-stream request gets one reply, at the end).

The scheduler's gauges (running and queued requests, KV usage, prefix-cache hit rate)
are not pushed: ``/metrics`` asks the schedulers for ``server_info`` at each scrape
and sets them from the answer (``set_scheduler_gauges``).

Counting: one per sequence, so a request with ``n=2`` counts twice in
``requests_total``, and its prompt twice in ``prompt_tokens_total``, as the
scheduler prefills it twice (the second mostly from the prefix cache: see
``cached_tokens_total``).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from runtime.protocol.spec_stats import spec_summary

PREFIX = "tinyserve:"
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Metrics:
    """The collectors, in a registry of their own (nothing from other libraries leaks in)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no "*_created" sample beside every counter (process-wide; nothing else uses it)
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(PREFIX + name, doc, ["model_name", *extra], registry=r)

        self.requests = counter(
            "requests", "Finished sequences by finish reason (stop, length, abort, error)", ("finish_reason",)
        )
        self.rejected = counter("rejected_requests", "Requests refused before they reached the scheduler", ("code",))
        self.refused = counter(
            "requests_refused",
            "Requests a scheduler refused on arrival, by reason (overloaded: --max-queued-requests); once per request",
            ("reason",),
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the sequences that started")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to the first token (streamed requests)",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between stream chunks divided by their tokens (streamed requests)",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token, per sequence",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.constrained_requests = counter(
            "constrained_requests",
            "Sequences with a json_schema / regex / ebnf constraint, by where their "
            "compiled grammar came from (compiled, cache)",
            ("grammar_source",),
        )
        self.grammar_compile = Histogram(
            PREFIX + "grammar_compile_seconds",
            "Compile time of a constrained sequence's grammar (cache misses)",
            ["model_name"],
            buckets=GRAMMAR_COMPILE_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.running = Gauge(
            PREFIX + "num_running_reqs", "Requests decoding in the schedulers", ["model_name"], registry=r
        ).labels(**labels)
        self.queued = Gauge(
            PREFIX + "num_queue_reqs", "Requests waiting in the schedulers", ["model_name"], registry=r
        ).labels(**labels)
        self.kv_usage = Gauge(
            PREFIX + "token_usage",
            "Fraction of the KV pool in use (cached prefixes excluded)",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.cache_hit_rate = Gauge(
            PREFIX + "cache_hit_rate", "Prompt tokens found in the prefix cache / looked up", ["model_name"], registry=r
        ).labels(**labels)
        self.spec_accept_length = Gauge(
            PREFIX + "spec_accept_length",
            "Speculative decoding: mean tokens a request emits per decode step (1 without accepted drafts)",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.spec_accept_rate = Gauge(
            PREFIX + "spec_accept_rate",
            "Speculative decoding: drafted tokens accepted / drafted",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self._model = model_name
        self._prompt = self.prompt_tokens.labels(**labels)
        self._generated = self.generation_tokens.labels(**labels)
        self._cached = self.cached_tokens.labels(**labels)
        self._by_reason: dict[str, Any] = {}

    # ------------------------------------------------------------------ events

    def started(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A sequence's first output: its prompt has been prefilled."""
        self._prompt.inc(prompt_tokens)
        self._cached.inc(cached_tokens)

    def constrained(self, compile_seconds: float, cache_hit: bool) -> None:
        """A constrained sequence's first output: how its grammar was had."""
        self.constrained_requests.labels(
            model_name=self._model, grammar_source="cache" if cache_hit else "compiled"
        ).inc()
        if not cache_hit:
            self.grammar_compile.observe(compile_seconds)

    def generated(self, num_tokens: int) -> None:
        if num_tokens:
            self._generated.inc(num_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def gap(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.itl.observe(seconds / num_tokens)

    def finished(self, reason: str, seconds: float | None) -> None:
        counter = self._by_reason.get(reason)
        if counter is None:
            counter = self._by_reason[reason] = self.requests.labels(model_name=self._model, finish_reason=reason)
        counter.inc()
        if seconds is not None:
            self.e2e.observe(seconds)

    def rejected_request(self, code: str) -> None:
        self.rejected.labels(model_name=self._model, code=code).inc()

    def refused_request(self, reason: str) -> None:
        self.refused.labels(model_name=self._model, reason=reason).inc()

    def set_scheduler_gauges(self, info: dict[str, Any]) -> None:
        """From a ``server_info`` answer (one scheduler, or the DP controller's sums)."""
        self.running.set(info.get("num_running", 0))
        self.queued.set(info.get("num_queued", 0))
        if "kv_usage" in info:
            self.kv_usage.set(info["kv_usage"])
        elif info.get("max_total_tokens"):
            free = info.get("available_tokens", 0) + info.get("evictable_tokens", 0)
            self.kv_usage.set(1.0 - free / info["max_total_tokens"])
        self.cache_hit_rate.set(info.get("cache_hit_rate", 0.0))
        spec = spec_summary(info)  # (empty without speculation: the gauges stay 0)
        if spec:
            self.spec_accept_length.set(spec["spec_accept_length"])
            self.spec_accept_rate.set(spec["spec_accept_rate"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
