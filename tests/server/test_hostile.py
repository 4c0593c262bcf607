"""Hostile input never takes the server down (issue 9, "Never falls over").

Every test sends something a careless or malicious client could send and asserts: the specific
status (a 4xx, never a 5xx), the full error body (``{"error": {...}, "code", "message",
"request_id"}``), an answer at all (httpx timeouts are hang detectors, never tight timings), and a
server that still serves afterwards (``/health`` 200 plus a normal small chat request).

Most tests use the session ``tiny_server``; settings that differ (small compile budget, admission
limits, request deadline, small body limit) get their own module-scoped server.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from server.config import Settings
from server.model_loader import ModelSource
from tests.conftest import start_server
from tests.server.hostile_util import (
    MODEL,
    assert_alive,
    assert_error,
    assert_not_server_error,
    assert_retry_after,
    chat,
    chat_body,
    post,
    sse_events,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MiB = 1024 * 1024
COMPILE_BUDGET = 2.0  # the constraint server's compile_timeout
CONSTRAINT_HANG = 30.0  # far above the budget: only catches a hang


def _own_server(tiny_model_dir, **overrides):
    fields = {"model": str(tiny_model_dir), "served_model_name": MODEL, "max_batch_size": 4, "max_model_len": 4096}
    settings = Settings(**(fields | overrides))
    return start_server(settings, ModelSource(tiny_model_dir, name=MODEL))


def _proc_status_bytes(field: str) -> int:
    """A size line of /proc/self/status (the test servers run in threads of this process)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_size() -> int:
    return _proc_status_bytes("VmSize")


@contextmanager
def _address_space_guard(headroom: int):
    """Cap this process's address space at its current size plus ``headroom`` for a while.

    The strict server takes the attacks that once ate all memory (a grammar without a base case
    made the engine grow until the kernel killed it, 24 GB). Until that is fixed, this turns the
    attack into a failed allocation inside the test process instead of a machine-wide OOM kill.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield  # already capped at least this tightly
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir):
    """A server with a small compile budget, so the pathological constraints answer fast; it also
    takes the chat-template attacks, so that a server that cannot bound them wedges only itself."""
    running, stop = _own_server(tiny_model_dir, compile_timeout=COMPILE_BUDGET)
    with _address_space_guard(8 * 1024 * MiB):
        yield running
    stop()


@pytest.fixture(scope="module")
def admission_server(tiny_model_dir):
    """One decode slot, two waiting places, a 64 KiB body limit."""
    running, stop = _own_server(tiny_model_dir, max_batch_size=1, max_waiting_seqs=2, max_body_bytes=64 * 1024)
    yield running
    stop()


@pytest.fixture(scope="module")
def deadline_server(tiny_model_dir):
    running, stop = _own_server(tiny_model_dir, max_batch_size=2, request_timeout=1.0)
    yield running
    stop()


def _rss_bytes() -> int:
    return _proc_status_bytes("VmRSS")


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    health = {}
    while time.monotonic() < deadline:
        health = httpx.get(server.base_url + "/health", timeout=10).json()
        if health.get("running") == 0 and health.get("waiting") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {health}")


# =========================================================================== malformed bodies


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}', id="in-string"),
        pytest.param(b"\xff\xfe{}", id="leading-bytes"),
        pytest.param(b'{"model": "tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}', id="bad-2-byte"),
        pytest.param(b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', id="utf8-surrogate"),
    ],
)
def test_invalid_utf8_is_invalid_json(tiny_server, content):
    assert_error(post(tiny_server, CHAT, content), 400, code="invalid_json")
    assert_alive(tiny_server)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(
            ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "metadata": {"x": '
             + _nested(65) + "}}").encode(),
            id="65-levels",
        ),
        pytest.param(
            ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": '
             '{"type": "json_schema", "json_schema": {"name": "t", "schema": '
             + '{"type": "array", "items": ' * 100 + "{}" + "}" * 100 + "}}}").encode(),
            id="100-levels-schema",
        ),
        pytest.param(_nested(100_000).encode(), id="100k-levels"),
        pytest.param(b"[" * 1_000_000, id="1M-unclosed"),
        pytest.param(b'{"a":' * 200_000 + b"1" + b"}" * 200_000, id="200k-objects"),
    ],
)
def test_deep_nesting_is_invalid_json(tiny_server, content):
    assert_error(post(tiny_server, CHAT, content), 400, code="invalid_json")
    assert_alive(tiny_server)


def test_body_over_default_limit_is_413(tiny_server):
    body = chat_body(messages=[{"role": "user", "content": "x" * (9 * MiB)}])
    assert_error(post(tiny_server, CHAT, body), 413)
    assert_alive(tiny_server)


def test_chunked_body_over_default_limit_is_413(tiny_server):
    """No Content-Length: the server must stop reading at the limit, not buffer everything."""

    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10 * 16):  # 10 MiB in 64 KiB pieces
            yield b"x" * (64 * 1024)
        yield b'"}]}'

    response = httpx.post(tiny_server.base_url + CHAT, content=chunks(), timeout=60,
                          headers={"content-type": "application/json"})
    assert_error(response, 413)
    assert_alive(tiny_server)


def test_configured_body_limit(admission_server):
    big = chat_body(messages=[{"role": "user", "content": "x" * (100 * 1024)}])
    assert_error(post(admission_server, CHAT, big), 413)
    assert_error(post(admission_server, COMPLETIONS, {"model": MODEL, "prompt": "y" * (100 * 1024)}), 413)
    small = post(admission_server, CHAT, chat_body(max_tokens=2))
    assert small.status_code == 200, small.text
    assert_alive(admission_server)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz", "application/xml"],
)
def test_wrong_content_type_is_415(tiny_server, content_type):
    assert_error(post(tiny_server, CHAT, chat_body(), content_type=content_type), 415)
    assert_error(post(tiny_server, COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                      content_type=content_type), 415)
    assert_alive(tiny_server)


@pytest.mark.parametrize("content_type", [None, "application/json", "application/json; charset=utf-8"])
def test_json_content_types_accepted(tiny_server, content_type):
    response = post(tiny_server, CHAT, chat_body(max_tokens=2), content_type=content_type)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


_GARBAGE = [
    pytest.param(CHAT, b"", id="empty-body"),
    pytest.param(CHAT, b"null", id="null"),
    pytest.param(CHAT, b'"just a string"', id="string"),
    pytest.param(CHAT, b"123", id="number"),
    pytest.param(CHAT, b"{", id="truncated"),
    pytest.param(CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}',
                 id="lone-surrogate"),
    pytest.param(CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 4}',
                 id="nul-char"),
    pytest.param(CHAT, json.dumps(chat_body(max_tokens=10**30)).encode(), id="max_tokens-huge"),
    pytest.param(CHAT, json.dumps(chat_body(n=10**20)).encode(), id="n-huge"),
    pytest.param(CHAT, json.dumps(chat_body(seed=2**70)).encode(), id="seed-huge"),
    pytest.param(CHAT, json.dumps(chat_body(seed=-(2**70))).encode(), id="seed-negative-huge"),
    pytest.param(CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
                 id="temperature-inf"),
    pytest.param(CHAT, json.dumps(chat_body(logit_bias={"-1": 1})).encode(), id="logit_bias-negative-id"),
    pytest.param(CHAT, json.dumps(chat_body(stop_token_ids=[-1])).encode(), id="stop_token_ids-negative"),
    pytest.param(CHAT, json.dumps(chat_body(logprobs=True, top_logprobs=10**9)).encode(), id="top_logprobs-huge"),
    pytest.param(CHAT, json.dumps(chat_body(min_tokens=10**9)).encode(), id="min_tokens-huge"),
    pytest.param(CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}])).encode(),
                 id="text-part-without-text"),
    pytest.param(CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": [{"type": "bogus", "x": 1}]}])).encode(),
                 id="unknown-part"),
    pytest.param(CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 5000}])).encode(),
                 id="5000-parts"),
    pytest.param(CHAT, json.dumps(chat_body(messages=[{"role": "tool", "content": "x"}])).encode(), id="tool-no-id"),
    pytest.param(CHAT, json.dumps(chat_body(tools=[{"type": "function", "function": 7}])).encode(), id="tool-not-object"),
    pytest.param(CHAT, json.dumps(chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": "no"}}],
                                            tool_choice="required")).encode(), id="tool-parameters-string"),
    pytest.param(CHAT, json.dumps(chat_body(tool_choice={"type": "function", "function": {"name": "nope"}})).encode(),
                 id="tool_choice-unknown"),
    pytest.param(CHAT, json.dumps(chat_body(response_format={"type": "nope"})).encode(), id="response_format-type"),
    pytest.param(CHAT, json.dumps(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": "s"}})).encode(),
                 id="schema-is-string"),
    pytest.param(CHAT, json.dumps(chat_body(guided_json="{not json")).encode(), id="guided_json-bad-string"),
    pytest.param(CHAT, json.dumps(chat_body(guided_regex="(")).encode(), id="regex-syntax"),
    pytest.param(CHAT, json.dumps(chat_body(chat_template_kwargs={"messages": 1})).encode(), id="template-kwargs-clash"),
    pytest.param(CHAT, json.dumps(chat_body(messages=[{"role": "user", "content": "word " * 200_000}])).encode(),
                 id="prompt-far-over-context"),
    pytest.param(COMPLETIONS, json.dumps({"model": MODEL, "prompt": [[-5]]}).encode(), id="prompt-negative-id"),
    pytest.param(COMPLETIONS, json.dumps({"model": MODEL, "prompt": [[10**12]]}).encode(), id="prompt-huge-id"),
    pytest.param(COMPLETIONS, json.dumps({"model": MODEL, "prompt": []}).encode(), id="prompt-empty-list"),
    pytest.param(COMPLETIONS, json.dumps({"model": MODEL, "prompt": [[]]}).encode(), id="prompt-empty-ids"),
    pytest.param(COMPLETIONS, json.dumps({"model": MODEL, "prompt": [1.5]}).encode(), id="prompt-float"),
]


@pytest.mark.parametrize(("path", "content"), _GARBAGE)
def test_garbage_never_5xx(tiny_server, path, content):
    assert_not_server_error(post(tiny_server, path, content))
    assert_alive(tiny_server)


def test_stalled_upload_does_not_block_others(tiny_server):
    """A client that announces a body and never sends it (slowloris) must not stall anyone else."""
    parts = urlsplit(tiny_server.base_url)
    sockets = []
    try:
        for _ in range(4):
            sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"model\": \"tiny\", ")
            sockets.append(sock)
        assert_alive(tiny_server)
    finally:
        for sock in sockets:
            sock.close()
    assert_alive(tiny_server)


# =========================================================================== size limits


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(CHAT, chat_body(messages=[{"role": "user", "content": "x"}] * 1025), "messages", id="1025-messages"),
        pytest.param(CHAT, chat_body(stop=[f"s{i}" for i in range(33)]), "stop", id="33-stops"),
        pytest.param(COMPLETIONS, {"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(33)]}, "stop",
                     id="33-stops-completions"),
        pytest.param(CHAT, chat_body(logit_bias={str(i): 1.0 for i in range(1025)}), "logit_bias", id="1025-logit_bias"),
        pytest.param(CHAT, chat_body(tools=[{"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {}}}} for i in range(129)]), "tools", id="129-tools"),
        pytest.param(COMPLETIONS, {"model": MODEL, "prompt": [f"p{i}" for i in range(129)], "n": 2, "max_tokens": 1},
                     "n", id="129-prompts-x2"),
        pytest.param(COMPLETIONS, {"model": MODEL, "prompt": ["a", "b", "c", "d", "e"], "n": 64, "max_tokens": 1},
                     "n", id="5-prompts-x64"),
    ],
)
def test_limits_are_400_naming_the_field(tiny_server, path, body, param):
    assert_error(post(tiny_server, path, body), 400, param=param)
    assert_alive(tiny_server)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"stop": [f"zq{i}" for i in range(32)]}, id="32-stops"),
        pytest.param({"logit_bias": {str(i): 0.5 for i in range(1024)}}, id="1024-logit_bias"),
    ],
)
def test_limits_are_inclusive(tiny_server, fields):
    response = chat(tiny_server, max_tokens=2, **fields)
    assert response.status_code == 200, response.text


# =========================================================================== pathological constraints


def _rf(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}


def _guided_json(schema):
    return {"guided_json": schema}


def _so_json(schema):
    return {"structured_outputs": {"json": schema}}


def _sgl_json(schema):
    return {"json_schema": json.dumps(schema)}


def _deep_schema_text(depth: int) -> str:
    """A schema nested ``depth`` objects deep, as JSON text (too deep for ``json.dumps``)."""
    level = '{"type": "object", "required": ["a"], "properties": {"a": '
    return level * depth + '{"type": "string"}' + "}}" * depth


DEEP = "__deep_schema__"  # stands for DEEP_SCHEMA_TEXT, spliced into the encoded body


EBNF_LOOP = 'root ::= "a" root'
LARK_LOOP = 'start: "a" start'
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF_REF = {"$ref": "#"}
DANGLING_REF = {"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}, "required": ["x"]}
REMOTE_REF = {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}, "required": ["x"]}
DEEP_SCHEMA_TEXT = _deep_schema_text(2000)
HUGE_ENUM = {"enum": [f"value-{i}" for i in range(100_000)]}
MAX_ITEMS = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 100_000}
BAD_EBNF = 'root ::= "a" | | (( "b"'
HUGE_GRAMMAR = "root ::= " + " | ".join(f'"w{i}"' for i in range(110_000))  # about 1.1 MB

_PATHOLOGICAL = [
    # EBNF without a base case (once OOM-killed the whole server) and its Lark twin.
    pytest.param({"guided_grammar": EBNF_LOOP}, id="ebnf-loop-guided_grammar"),
    pytest.param({"structured_outputs": {"grammar": EBNF_LOOP}}, id="ebnf-loop-structured_outputs"),
    pytest.param({"ebnf": EBNF_LOOP}, id="ebnf-loop-sglang"),
    pytest.param({"guided_grammar": LARK_LOOP}, id="lark-loop-guided_grammar"),
    pytest.param({"structured_outputs": {"grammar": LARK_LOOP}}, id="lark-loop-structured_outputs"),
    # $ref trouble.
    pytest.param(_rf(REF_CYCLE), id="ref-cycle-response_format"),
    pytest.param(_guided_json(REF_CYCLE), id="ref-cycle-guided_json"),
    pytest.param(_so_json(SELF_REF), id="self-ref-structured_outputs"),
    pytest.param(_rf(DANGLING_REF), id="dangling-ref-response_format"),
    pytest.param(_sgl_json(DANGLING_REF), id="dangling-ref-sglang"),
    pytest.param(_guided_json(REMOTE_REF), id="remote-ref-guided_json"),
    pytest.param(_so_json(REMOTE_REF), id="remote-ref-structured_outputs"),
    # Size: nesting, enums, repetition counts, grammar text.
    pytest.param(_rf(DEEP), id="deep-schema-response_format"),
    pytest.param({"json_schema": DEEP_SCHEMA_TEXT}, id="deep-schema-sglang-string"),
    pytest.param({"guided_json": DEEP_SCHEMA_TEXT}, id="deep-schema-guided_json-string"),
    pytest.param(_rf(HUGE_ENUM), id="huge-enum-response_format"),
    pytest.param(_sgl_json(HUGE_ENUM), id="huge-enum-sglang"),
    pytest.param({"guided_grammar": HUGE_GRAMMAR}, id="1MB-grammar"),
    # Syntax and emptiness.
    pytest.param({"guided_grammar": BAD_EBNF}, id="bad-ebnf-guided_grammar"),
    pytest.param({"ebnf": BAD_EBNF}, id="bad-ebnf-sglang"),
    pytest.param({"guided_regex": "a^b"}, id="unsatisfiable-regex-guided_regex"),
    pytest.param({"regex": "a^b"}, id="unsatisfiable-regex-sglang"),
    pytest.param({"structured_outputs": {"regex": "a^b"}}, id="unsatisfiable-regex-structured_outputs"),
    pytest.param({"guided_choice": []}, id="empty-choice-guided_choice"),
    pytest.param({"structured_outputs": {"choice": []}}, id="empty-choice-structured_outputs"),
]


@pytest.mark.parametrize("fields", _PATHOLOGICAL)
def test_pathological_constraint_is_400(strict_server, fields):
    before = _rss_bytes()
    content = json.dumps(chat_body(max_tokens=16, **fields)).replace(json.dumps(DEEP), DEEP_SCHEMA_TEXT)
    response = post(strict_server, CHAT, content.encode(), timeout=CONSTRAINT_HANG)
    assert_error(response, 400)
    assert_alive(strict_server)
    grown = _rss_bytes() - before
    assert grown < 2 * 1024 * MiB, f"resident memory grew by {grown / MiB:.0f} MiB"


@pytest.mark.parametrize(
    ("fields", "schema"),
    [
        pytest.param(_guided_json(MAX_ITEMS), MAX_ITEMS, id="maxItems-guided_json"),
        pytest.param(_rf({"type": "object", "properties": {"xs": MAX_ITEMS}, "required": ["xs"]}),
                     {"type": "object", "properties": {"xs": MAX_ITEMS}, "required": ["xs"]},
                     id="maxItems-nested-response_format"),
    ],
)
def test_large_repetition_count_is_400_or_valid(strict_server, fields, schema):
    """A bound like maxItems: 100000 is enforceable lazily; refusing it is allowed, a 5xx or an
    invalid finished output is not."""
    import jsonschema

    before = _rss_bytes()
    response = chat(strict_server, max_tokens=24, timeout=CONSTRAINT_HANG, **fields)
    assert response.status_code in (200, 400), response.text[:2000]
    if response.status_code == 400:
        assert_error(response, 400)
    else:
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert_alive(strict_server)
    assert _rss_bytes() - before < 2 * 1024 * MiB


@pytest.mark.parametrize(
    ("fields", "regex", "prefix"),
    [
        pytest.param({"guided_regex": "(a+)+$"}, "(a+)+$", "a*", id="nested-plus-guided_regex"),
        pytest.param({"regex": "(a+)+$"}, "(a+)+$", "a*", id="nested-plus-sglang"),
        pytest.param({"structured_outputs": {"regex": "(a|aa)*b"}}, "(a|aa)*b", "a*b?", id="alternation-structured_outputs"),
        pytest.param({"guided_regex": "(a|aa)*b"}, "(a|aa)*b", "a*b?", id="alternation-guided_regex"),
    ],
)
def test_redos_regex_is_400_or_valid(strict_server, fields, regex, prefix):
    response = chat(strict_server, max_tokens=24, timeout=CONSTRAINT_HANG, **fields)
    assert response.status_code in (200, 400), response.text[:2000]
    if response.status_code == 400:
        assert_error(response, 400)
    else:
        choice = response.json()["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert re.fullmatch(regex, text), repr(text)
        else:  # cut by max_tokens: what there is must still be on the way to a match
            assert choice["finish_reason"] == "length", choice
            assert re.fullmatch(prefix, text), repr(text)
    assert_alive(strict_server)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pathological_constraint_on_completions(strict_server, stream):
    body = {"model": MODEL, "prompt": "Say a", "max_tokens": 16, "stream": stream, "guided_grammar": EBNF_LOOP}
    assert_error(post(strict_server, COMPLETIONS, body, timeout=CONSTRAINT_HANG), 400)
    assert_alive(strict_server)


def test_pathological_constraint_streamed_chat_is_400_before_streaming(strict_server):
    response = chat(strict_server, stream=True, timeout=CONSTRAINT_HANG, ebnf=EBNF_LOOP)
    assert_error(response, 400)
    assert_alive(strict_server)


def test_concurrent_pathological_constraints(strict_server):
    """A burst of different bad constraints at once: all refused, nothing else harmed."""
    bodies = [
        {"guided_grammar": EBNF_LOOP},
        {"guided_grammar": LARK_LOOP},
        _guided_json(REF_CYCLE),
        {"guided_regex": "a^b"},
        _rf(HUGE_ENUM),
        {"guided_grammar": f'root ::= "{uuid.uuid4().hex}" root'},  # not cached: compiled anew
    ]
    results: list[httpx.Response | BaseException] = [None] * len(bodies)  # type: ignore[list-item]

    def send(i: int) -> None:
        try:
            results[i] = chat(strict_server, max_tokens=8, timeout=CONSTRAINT_HANG, **bodies[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    assert_alive(strict_server)  # served while the bad ones are being refused
    for t in threads:
        t.join(timeout=2 * CONSTRAINT_HANG)
    for result in results:
        assert isinstance(result, httpx.Response), result
        assert_error(result, 400)
    assert_alive(strict_server)


# =========================================================================== chat templates


@pytest.mark.parametrize(
    "template",
    [
        pytest.param("{% for i in range(10**9) %}x{% endfor %}", id="billion-loop"),
        # 10**9 iterations, tiny output: past the sandbox's range limit, ~40 s unbounded.
        pytest.param("{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}ok",
                     id="nested-loops"),
        pytest.param("{{ 'x' * 10**8 }}", id="100MB-output"),
        pytest.param("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", id="infinite-recursion"),
    ],
)
def test_runaway_chat_template_is_400(strict_server, template):
    response = chat(strict_server, chat_template=template, timeout=30)
    assert_error(response, 400)
    assert_alive(strict_server)


@pytest.mark.parametrize(
    "template",
    [
        pytest.param("{{ raise_exception('boom') }}", id="raise_exception"),
        pytest.param("{% for x in %}{% endfor %}", id="syntax-error"),
        pytest.param("{{ messages | no_such_filter }}", id="unknown-filter"),
        pytest.param("{{ 1 / 0 }}", id="zero-division"),
    ],
)
def test_failing_chat_template_is_400_naming_it(strict_server, template):
    response = chat(strict_server, chat_template=template, timeout=30)
    assert_error(response, 400, param="chat_template")
    assert_alive(strict_server)


# =========================================================================== admission control


def _hold_stream(server, results: list, release: threading.Event) -> None:
    body = chat_body(max_tokens=3000, ignore_eos=True, stream=True)
    try:
        with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=60) as response:
            results.append(response.status_code)
            if response.status_code != 200:
                response.read()
                return
            for _ in response.iter_lines():
                if release.is_set():
                    return
    except httpx.HTTPError as exc:
        results.append(exc)


def test_full_queue_answers_429_with_retry_after(admission_server):
    """1 running + 2 waiting fills it: the next request, plain or streamed, is a 429 at once."""
    release = threading.Event()
    statuses: list = []
    holders = [threading.Thread(target=_hold_stream, args=(admission_server, statuses, release)) for _ in range(3)]
    try:
        for t in holders:
            t.start()
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while True:
            health = httpx.get(admission_server.base_url + "/health", timeout=10)
            assert health.status_code == 200  # liveness answers while saturated
            state = health.json()
            if state["running"] == 1 and state["waiting"] == 2:
                break
            assert time.monotonic() < deadline, f"queue never filled: {state}, {statuses}"
            time.sleep(0.05)
        plain = chat(admission_server, max_tokens=4, timeout=30)
        error = assert_error(plain, 429)
        assert error["type"] == "rate_limit_error", error
        assert_retry_after(plain)
        streamed = chat(admission_server, max_tokens=4, stream=True, timeout=30)
        assert_error(streamed, 429)
        assert_retry_after(streamed)
        completion = post(admission_server, COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)
        assert_error(completion, 429)
        assert_retry_after(completion)
    finally:
        release.set()
        for t in holders:
            t.join(timeout=60)
    _wait_idle(admission_server)
    assert_alive(admission_server)


def test_burst_gets_429s_and_the_rest_completes(admission_server):
    count, max_tokens = 8, 200
    results: list = [None] * count

    def send(i: int) -> None:
        try:
            results[i] = chat(admission_server, max_tokens=max_tokens, ignore_eos=True, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert all(isinstance(r, httpx.Response) for r in results), results
    refused = [r for r in results if r.status_code == 429]
    served = [r for r in results if r.status_code != 429]
    assert refused, [r.status_code for r in results]
    for response in refused:
        assert_error(response, 429)
        assert_retry_after(response)
    assert served, "admission refused everything"
    for response in served:
        assert response.status_code == 200, response.text[:2000]
        assert response.json()["usage"]["completion_tokens"] == max_tokens
    _wait_idle(admission_server)
    assert_alive(admission_server)


# =========================================================================== request deadline


def test_request_deadline_non_stream_is_504(deadline_server):
    response = chat(deadline_server, max_tokens=4000, ignore_eos=True, timeout=60)
    assert_error(response, 504, code="request_timeout")
    _wait_idle(deadline_server)
    assert_alive(deadline_server)


def test_request_deadline_stream_ends_with_error_event(deadline_server):
    response = chat(deadline_server, max_tokens=4000, ignore_eos=True, stream=True, timeout=60)
    assert response.status_code == 200, response.text[:2000]
    events = sse_events(response.text)
    assert events, response.text[:2000]
    if events[-1] == "[DONE]":
        events = events[:-1]
    assert events, "no error event before the end"
    last = json.loads(events[-1])
    assert "error" in last, f"stream did not end with an error event: {events[-1][:500]}"
    assert set(last["error"]) >= {"message", "type", "param", "code"}, last
    assert all("[DONE]" not in e for e in events), "data after [DONE]"
    _wait_idle(deadline_server)
    assert_alive(deadline_server)


def test_request_deadline_completions(deadline_server):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4000, "ignore_eos": True}
    assert_error(post(deadline_server, COMPLETIONS, body, timeout=60), 504, code="request_timeout")
    _wait_idle(deadline_server)
    assert_alive(deadline_server)


# =========================================================================== health, readiness, metrics


def _metrics(server) -> tuple[dict[str, list[tuple[dict, float]]], dict[str, str]]:
    """Samples by name and family types by name, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(server.base_url + "/metrics", timeout=30)
    assert response.status_code == 200, response.text[:2000]
    assert response.headers["content-type"].startswith("text/plain"), response.headers
    samples: dict[str, list[tuple[dict, float]]] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples, types


def _total(samples, name: str, **labels: str) -> float:
    return sum(v for l, v in samples.get(name, []) if all(l.get(k) == x for k, x in labels.items()))


def test_health_and_ready(tiny_server):
    health = httpx.get(tiny_server.base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = httpx.get(tiny_server.base_url + "/ready", timeout=30)
    assert ready.status_code == 200, ready.text


def test_metrics_names_and_types(tiny_server):
    chat(tiny_server, max_tokens=2)  # at least one request on record
    samples, types = _metrics(tiny_server)

    def declared(name: str) -> str | None:
        # the parser names a counter's family without its "_total"; labelled families may have no samples yet
        return types.get(name) or types.get(name.removesuffix("_total"))

    for name in ("trellis_requests_total", "trellis_running_sequences", "trellis_waiting_sequences",
                 "trellis_time_to_first_token_seconds", "trellis_prompt_tokens_total",
                 "trellis_generation_tokens_total", "trellis_constraint_compile_seconds",
                 "trellis_constraint_refusals_total", "trellis_engine_overlapped_steps",
                 "trellis_forward_device_ms", "trellis_mask_fill_ms"):
        assert declared(name), f"{name} missing from /metrics: {sorted(types)}"
    assert declared("trellis_engine_overlapped_steps") == declared("trellis_mask_fill_ms") == "gauge"
    assert declared("trellis_requests_total") == "counter"
    assert declared("trellis_running_sequences") == "gauge"
    assert declared("trellis_waiting_sequences") == "gauge"
    assert declared("trellis_time_to_first_token_seconds") == "histogram"
    assert declared("trellis_constraint_compile_seconds") in ("histogram", "summary")
    assert "trellis_requests_total" in samples  # the request above is on record
    assert "trellis_time_to_first_token_seconds_bucket" in samples


def test_metrics_move_with_requests(tiny_server):
    _wait_idle(tiny_server)
    before, _ = _metrics(tiny_server)
    assert_error(chat(tiny_server, temperature=5), 400, param="temperature")
    good = chat(tiny_server, max_tokens=5, ignore_eos=True)
    assert good.status_code == 200
    usage = good.json()["usage"]
    refused = chat(tiny_server, guided_regex="a^b", max_tokens=4)
    assert_error(refused, 400)
    compiled = chat(tiny_server, guided_regex=f"z{uuid.uuid4().hex[:8]}", max_tokens=4)  # fresh: not cached
    assert compiled.status_code == 200, compiled.text
    after, _ = _metrics(tiny_server)

    def grew(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert grew("trellis_requests_total", status="400") >= 2
    assert grew("trellis_requests_total", status="200") >= 2
    assert grew("trellis_prompt_tokens_total") >= usage["prompt_tokens"]
    assert grew("trellis_generation_tokens_total") >= usage["completion_tokens"]
    assert grew("trellis_time_to_first_token_seconds_count") >= 2
    assert grew("trellis_constraint_refusals_total") >= 1
    compile_counts = [n for n in after if n.startswith("trellis_constraint_compile_seconds") and n.endswith("_count")]
    assert compile_counts, sorted(after)
    assert sum(grew(n) for n in compile_counts) >= 1
    _wait_idle(tiny_server)
    idle, _ = _metrics(tiny_server)
    assert _total(idle, "trellis_running_sequences") == 0
    assert _total(idle, "trellis_waiting_sequences") == 0
