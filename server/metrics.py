"""Prometheus metrics (prometheus-client), one registry per app so test servers don't collide."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    """Every counter, gauge and histogram Trellis exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter("trellis_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.request_latency = Histogram(
            "trellis_request_latency_seconds", "time from request to last byte", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("trellis_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("trellis_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "trellis_time_to_first_token_seconds", "time from request to first generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "trellis_time_per_output_token_seconds", "mean time between output tokens of a request",
            buckets=_TOKEN_TIME_BUCKETS, registry=r,
        )
        self.rejected = Counter("trellis_rejected_requests", "requests refused by admission control", ["reason"],
                                registry=r)
        self.compile_seconds = Histogram(
            "trellis_constraint_compile_seconds", "constraint compile time (cache misses and hits)",
            ["kind"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.refusals = Counter("trellis_constraint_refusals", "constraints refused, by code and keyword",
                                ["code", "keyword"], registry=r)
        self.image_bytes = Counter("trellis_image_bytes", "encoded image bytes received (vision-language models)",
                                   registry=r)
        self.image_seconds = Histogram(
            "trellis_image_preprocess_seconds", "image processor time per request (resize, tiling, patches)",
            buckets=_TOKEN_TIME_BUCKETS, registry=r,
        )
        self.tagged = Counter("trellis_tagged_requests", "generation requests per client tag", ["tag"], registry=r)
        self.keyword_labels = BoundedLabels()
        self.tag_labels = BoundedLabels()

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge whose value is read at scrape time."""
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def watch_many(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        """Several gauges read together at scrape time: ``{name: (help, value)}``."""
        self.registry.register(_Snapshot(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BoundedLabels:
    """Label values chosen by clients (schema keywords, tags): the first ``limit`` distinct short
    values are kept, everything else is ``other``, so a client cannot grow the series without end."""

    def __init__(self, limit: int = 64, max_length: int = 40) -> None:
        self.limit = limit
        self.max_length = max_length
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if not value:
            return "none"
        if value in self._seen:
            return value
        if len(self._seen) < self.limit and len(value) <= self.max_length and value.replace("_", "").replace("-", "").isalnum():
            self._seen.add(value)
            return value
        return "other"


class _Snapshot:
    def __init__(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self._read = read

    def collect(self):
        for name, (help_text, value) in self._read().items():
            yield GaugeMetricFamily(name, help_text, value=value)

    def describe(self):
        return []
