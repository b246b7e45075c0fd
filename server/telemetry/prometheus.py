"""Prometheus metrics for GET /metrics: vLLM's names where vLLM has the metric, `hotlora_*` else.

Each app has its own registry. Counters and histograms are fed as requests run (`RequestStats`)
and as the scheduler decodes; the gauges are read from the runtime at scrape time, so they read
0 before the model is ready.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from hotlora.adapters import MountEvent
    from hotlora.server.runtime import Runtime

CONTENT_TYPE = CONTENT_TYPE_LATEST

# An adapter's first load: from a few milliseconds (small, cached files) to seconds.
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# vLLM's buckets, with finer steps below 10 ms for small models decoding on Apple silicon.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# vLLM's 1-2-5 steps for token counts, here up to 100,000 whatever the context.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= 100_000)
# vLLM's buckets for a request's phases (queue, prefill, decode, inference).
PHASE_BUCKETS = E2E_BUCKETS

# vLLM's `finished_reason` values; hotlora's own "cancelled" is vLLM's "abort".
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class Metrics:
    """One app's metrics and their registry; `exposition()` is the body of GET /metrics."""

    def __init__(self) -> None:
        # No `*_created` series beside each counter and histogram (process-wide, as vLLM does).
        disable_created_metrics()
        self.registry = CollectorRegistry()
        # The base model's served id: vLLM's `model_name` label, and the `adapter` label of
        # requests served by the base alone. Set once the model is loaded.
        self.model_name = ""
        model = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", model, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens of finished requests.", model, registry=r
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prompt cache.",
            model,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prompt cache.", model, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished choices by finish reason (a request with n choices counts n).",
            [*model, "finished_reason"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's arrival to each choice's first token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive pieces of text of a choice.",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last event.",
            model,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds per generated token after the first, per choice (its decode time over its "
            "tokens but one).",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens per finished request.",
            model,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request, all its choices together.",
            model,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "The most tokens any one choice of a finished request generated.",
            model,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Seconds from a request's arrival until its first row was admitted to the batch.",
            model,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Seconds from a request's admission to its first token.",
            model,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Seconds from a request's first token to its last event.",
            model,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds",
            "Seconds from a request's admission to its last event (prefill and decode).",
            model,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "hotlora_decode_batch_size",
            "Sequences decoded together, per decode step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        adapter = ["adapter"]
        self.adapter_requests = Counter(
            "hotlora_adapter_requests",
            "Requests served, per adapter in their set (the base model's id: no adapter).",
            adapter,
            registry=r,
        )
        self.adapter_prompt_tokens = Counter(
            "hotlora_adapter_prompt_tokens",
            "Prompt tokens of finished requests, per adapter in their set.",
            adapter,
            registry=r,
        )
        self.adapter_generation_tokens = Counter(
            "hotlora_adapter_generation_tokens",
            "Generated tokens of finished requests, per adapter in their set.",
            adapter,
            registry=r,
        )
        self.not_reading = Counter(
            "hotlora_client_not_reading",
            "Requests ended because their client took none of --max-unsent-tokens generated "
            "tokens.",
            registry=r,
        )
        self.adapter_mounts = Counter(
            "hotlora_adapter_mounts",
            "Adapters mounted, whatever asked for it (a replace counts).",
            registry=r,
        )
        self.adapter_unmounts = Counter(
            "hotlora_adapter_unmounts",
            "Adapters unmounted, whatever asked for it (evictions aside).",
            registry=r,
        )
        self.adapter_evictions = Counter(
            "hotlora_adapter_evictions",
            "Adapters unmounted to keep within --max-mounted-adapters or "
            "--adapter-memory-bytes (mounted again when a request names them).",
            registry=r,
        )
        self.adapter_loads = Counter(
            "hotlora_adapter_loads",
            "Adapters mounted because a request named them: with --auto-mount, or evicted.",
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "hotlora_adapter_load_seconds",
            "Seconds a load on first use took, files read to arrays mounted.",
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.adapter_refusals = Counter(
            "hotlora_adapter_refusals",
            "Refused mounts and unmounts, by operation and error code.",
            ["op", "reason"],
            registry=r,
        )

    def watch(self, runtime: Runtime) -> None:
        """Read the gauges from `runtime` at every scrape."""
        self.registry.register(_Gauges(runtime, self))

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)

    # What requests report (`RequestStats`).

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(self.model_name).observe(seconds)

    def between_tokens(self, seconds: float) -> None:
        self.inter_token_latency.labels(self.model_name).observe(seconds)

    def per_output_token(self, seconds: float) -> None:
        self.time_per_output_token.labels(self.model_name).observe(seconds)

    def phases(self, *, queue: float, prefill: float | None, decode: float | None) -> None:
        """One request's time waiting, prefilling (to its first token) and decoding; a request
        that ended before its first token has no prefill or decode time."""
        model = self.model_name
        self.queue_time.labels(model).observe(queue)
        if prefill is None or decode is None:
            return
        self.prefill_time.labels(model).observe(prefill)
        self.decode_time.labels(model).observe(decode)
        self.inference_time.labels(model).observe(prefill + decode)

    def finished(self, reason: str) -> None:
        """One choice ended: `stop`, `length`, `cancelled`, or `error`."""
        label = FINISHED_REASONS.get(reason, reason)
        self.request_success.labels(self.model_name, label).inc()

    def request(
        self,
        adapters: Iterable[str],
        *,
        prompt_tokens: int,
        generation_tokens: int,
        most_generated: int,
        cached_tokens: int,
        seconds: float,
    ) -> None:
        """One request ended, served with these adapter ids (none: the base alone);
        `most_generated`: the tokens of its longest choice."""
        model = self.model_name
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generation_tokens)
        self.request_prompt_tokens.labels(model).observe(prompt_tokens)
        self.request_generation_tokens.labels(model).observe(generation_tokens)
        self.request_max_generation_tokens.labels(model).observe(most_generated)
        self.prefix_cache_queries.labels(model).inc(prompt_tokens)
        self.prefix_cache_hits.labels(model).inc(cached_tokens)
        self.e2e_latency.labels(model).observe(seconds)
        self._per_adapter(adapters, prompt_tokens, generation_tokens)

    def embedded(self, adapters: Iterable[str], *, prompt_tokens: int) -> None:
        """One embeddings request served with these adapter ids: its prompt tokens and its
        adapters' counts (it generates nothing, so no generation metric hears of it)."""
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self._per_adapter(adapters, prompt_tokens, generation_tokens=0)

    def _per_adapter(
        self, adapters: Iterable[str], prompt_tokens: int, generation_tokens: int
    ) -> None:
        """A request's counts for each adapter of its set, the base model's id for none."""
        for adapter_id in tuple(adapters) or (self.model_name,):
            self.adapter_requests.labels(adapter_id).inc()
            self.adapter_prompt_tokens.labels(adapter_id).inc(prompt_tokens)
            self.adapter_generation_tokens.labels(adapter_id).inc(generation_tokens)

    def client_not_reading(self) -> None:
        """A request was ended because its client took none of its latest tokens."""
        self.not_reading.inc()

    # What the scheduler and the adapter admin report.

    def decoded(self, batch: int) -> None:
        """A decode step ran `batch` sequences (called on the generation thread)."""
        self.batch_size.observe(batch)

    def adapter_changed(self, event: MountEvent) -> None:
        """The adapter manager's listener: count each mount, load, unmount and eviction."""
        counters = {
            "mounted": self.adapter_mounts,
            "loaded": self.adapter_loads,
            "unmounted": self.adapter_unmounts,
            "evicted": self.adapter_evictions,
        }
        counters[event.kind].inc()
        if event.kind == "loaded":
            self.adapter_load_seconds.observe(event.seconds)

    def adapter_refused(self, op: str, reason: str | None) -> None:
        self.adapter_refusals.labels(op, reason or "error").inc()


class _Gauges(Collector):
    """The gauges, read from the runtime's load snapshot at scrape time; zeros while nothing is
    loaded."""

    def __init__(self, runtime: Runtime, metrics: Metrics):
        self.runtime = runtime
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        runtime, model = self.runtime, self.metrics.model_name
        load, adapters = runtime.load_snapshot(), runtime.adapters
        running, waiting, kv_usage = load.running, load.waiting, load.kv_usage
        running_adapters, waiting_adapters = load.running_adapters, load.waiting_adapters
        cache_entries, cache_bytes = load.prompt_cache_entries, load.prompt_cache_bytes
        cache_usage = load.prompt_cache_usage
        mounted = len(adapters.list()) if adapters is not None else 0

        yield _gauge(
            "vllm:num_requests_running",
            "Requests with a choice being prefilled or decoded.",
            model,
            running,
        )
        yield _gauge(
            "vllm:num_requests_waiting",
            "Admitted requests waiting for room in the batch.",
            model,
            waiting,
        )
        yield _gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache reserved by the batch over --kv-cache-bytes (1 is all of it; one request "
            "alone may exceed it).",
            model,
            kv_usage,
        )
        # The name vLLM's older dashboards read, Grafana's example among them.
        yield _gauge(
            "vllm:gpu_cache_usage_perc",
            "The same as vllm:kv_cache_usage_perc, under vLLM's earlier name.",
            model,
            kv_usage,
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Rows taken out of the batch to make room: always 0, as a row is admitted only "
            "when the KV cache it may reach fits, and then runs to its end.",
            labels=["model_name"],
        )
        preemptions.add_metric([model], 0)
        yield preemptions
        settings = runtime.settings
        cache = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV and prompt cache settings, as labels; the value is 1.",
            labels=[
                "model_name",
                "kv_cache_bytes",
                "enable_prefix_caching",
                "prompt_cache_bytes",
                "prompt_cache_size",
            ],
        )
        cache.add_metric(
            [
                model,
                str(settings.kv_cache_bytes),
                str(settings.prompt_cache_size > 0),
                str(settings.prompt_cache_bytes),
                str(settings.prompt_cache_size),
            ],
            1,
        )
        yield cache
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters of running and waiting requests (comma lists); max_lora: the adapters "
            "mounted, any of which may run in a batch. The value is the scrape time.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        lora.add_metric(
            [str(mounted), ",".join(sorted(waiting_adapters)), ",".join(sorted(running_adapters))],
            time.time(),
        )
        yield lora
        yield _gauge(
            "hotlora_prompt_cache_entries",
            "Prompt KV caches kept for reuse, prompt heads included.",
            model,
            cache_entries,
        )
        yield _gauge(
            "hotlora_prompt_cache_bytes",
            "Memory the kept prompt caches and prompt heads hold.",
            model,
            cache_bytes,
        )
        yield _gauge(
            "hotlora_prompt_cache_usage_perc",
            "Prompt cache bytes over --prompt-cache-bytes plus --prompt-heads-bytes (1 is all).",
            model,
            cache_usage,
        )
        yield _gauge("hotlora_adapters_mounted", "Adapters mounted now.", model, mounted)
        yield _gauge(
            "hotlora_requests_paused",
            "Running requests whose rows are paused: their client takes none of their tokens.",
            model,
            load.paused,
        )
        resident = GaugeMetricFamily(
            "hotlora_adapter_resident_bytes",
            "Memory each resident adapter's arrays hold.",
            labels=["adapter"],
        )
        for info in adapters.list() if adapters is not None else ():
            resident.add_metric([info.id], info.ram_bytes)
        yield resident
        phases = GaugeMetricFamily(
            "hotlora_startup_phase_seconds", "How long each start-up phase took.", labels=["phase"]
        )
        for phase, seconds in dict(runtime.phases).items():
            phases.add_metric([phase], seconds)
        yield phases


def _gauge(name: str, documentation: str, model: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
    gauge.add_metric([model], value)
    return gauge
