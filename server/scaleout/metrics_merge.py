"""One Prometheus exposition from many replicas' (each series gains a ``replica`` label)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Families:
    """A collector handing ``generate_latest`` families already built."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_metrics(texts: dict[str, bytes], entry_gauges: dict[str, tuple[str, float]] | None = None) -> bytes:
    """The replicas' metrics (``{replica id: Prometheus text}``) as one text, plus the entry's gauges."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode("utf-8")):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                target.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar))
    for name, (documentation, value) in (entry_gauges or {}).items():
        gauge = Metric(name, documentation, "gauge")
        gauge.add_sample(name, {}, float(value))
        merged[name] = gauge
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
