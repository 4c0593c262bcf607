"""The affinity key and the metrics merge of the scale-out package (no Ray needed)."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics
from server.scaleout.keys import PREFIX_CHARS, affinity_key
from server.scaleout.metrics_merge import merge_metrics

CHAT = "/v1/chat/completions"


def _key(body: dict, path: str = CHAT) -> str | None:
    return affinity_key("POST", path, msgspec.json.encode(body))


def test_same_leading_prompt_and_schema_share_a_key():
    prefix = "x" * PREFIX_CHARS
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    reordered = {"properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "type": "object"}
    one = _key({"messages": [{"role": "user", "content": prefix + " tail one"}], "guided_json": schema})
    two = _key({"messages": [{"role": "user", "content": prefix + " tail two"}], "guided_json": reordered})
    assert one is not None and one == two


def test_prompt_constraint_and_cache_key_change_the_key():
    base = {"messages": [{"role": "user", "content": "hello"}]}
    keys = {
        _key(base),
        _key({"messages": [{"role": "user", "content": "goodbye"}]}),
        _key({**base, "guided_regex": "[a-z]+"}),
        _key({**base, "prompt_cache_key": "tenant-7"}),
        _key({"prompt": "hello"}, "/v1/completions"),
        _key({"prompt": [1, 2, 3]}, "/v1/completions"),
    }
    assert None not in keys and len(keys) == 6
    assert _key({**base, "prompt_cache_key": "tenant-7"}) == _key({"messages": [], "prompt_cache_key": "tenant-7"})


def test_requests_without_a_key():
    assert affinity_key("GET", "/v1/models", b"") is None
    assert affinity_key("POST", CHAT, b"{not json") is None
    assert affinity_key("POST", CHAT, b"[1, 2]") is None
    assert affinity_key("POST", "/v1/conversations", b'{"messages": []}') is None


def test_merged_metrics_label_each_replica():
    first, second = Metrics(), Metrics()
    first.requests.labels(route="/v1/completions", status="200").inc(3)
    second.requests.labels(route="/v1/completions", status="200").inc(5)
    text = merge_metrics({"r1": first.render(), "r2": second.render()}, {"trellis_scaleout_replicas": ("replicas", 2)})
    families = {family.name: family for family in text_string_to_metric_families(text.decode())}
    totals = {s.labels["replica"]: s.value for s in families["trellis_requests"].samples if s.name == "trellis_requests_total"}
    assert totals == {"r1": 3.0, "r2": 5.0}
    assert families["trellis_scaleout_replicas"].samples[0].value == 2.0
