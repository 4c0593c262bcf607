"""Property-based fuzzing of the whole HTTP surface from the server's own OpenAPI document.

Schemathesis reads ``/docs/openapi.json`` from the running ``tiny_server`` and generates requests
for every operation, schema-valid (positive) and schema-breaking (negative). Every answer must
come back (a generous timeout is the hang detector), never be a 5xx (schemathesis'
``not_a_server_error``), and every 4xx must carry the full error body. At the end the server is
still alive and idle.

Where the served document does not describe a request body (handlers that read the raw body show
none), the body schema is taken from the wire structs in ``server.protocol`` (what the server
decodes with), so the fuzzer still reaches the body parser and everything behind it.

Bounded: a fixed number of examples per operation, no shrinking, no deadline; generated bodies get
``max_tokens``/``n``/prompt counts clamped so each tiny-model generation stays short.
"""

from __future__ import annotations

import copy
import time

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis.errors import Unsatisfiable
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.hostile_util import MODEL, assert_alive

EXAMPLES_PER_OPERATION = 120
RESPONSE_TIMEOUT = 60.0  # seconds; hang detector only
MAX_TOKENS = 8
MAX_N = 2
MAX_PROMPTS = 4

_BODY_STRUCTS = {
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/completions", "post"): CompletionRequest,
}


def _with_request_bodies(document: dict) -> dict:
    """The served document, plus JSON request bodies from ``server.protocol`` where it has none."""
    document = copy.deepcopy(document)
    structs = [s for (path, method), s in _BODY_STRUCTS.items()
               if "requestBody" not in document.get("paths", {}).get(path, {}).get(method, {"requestBody": 1})]
    if not structs:
        return document
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in components.items():
        schemas.setdefault(name, schema)
    for struct, ref in zip(structs, refs):
        path, method = next(k for k, v in _BODY_STRUCTS.items() if v is struct)
        document["paths"][path][method]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref}},
        }
    return document


def _operation_labels() -> list[str]:
    """Operations of the app's OpenAPI document, built from the app itself (no model, no server)
    so that pytest can list one test per operation; the live document is checked to match."""
    from server.app import create_app
    from server.config import Settings

    document = create_app(Settings()).openapi_schema.to_schema()
    return sorted(f"{method.upper()} {path}" for path, item in document["paths"].items()
                  for method in item if method in _METHODS)


_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
OPERATIONS = _operation_labels()


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    """The live document, loaded from the running server's URL."""
    served = httpx.get(tiny_server.base_url + "/docs/openapi.json", timeout=30)
    assert served.status_code == 200, served.text
    document = _with_request_bodies(served.json())
    config = schemathesis.Config.from_dict({
        "base-url": tiny_server.base_url,
        "request-timeout": RESPONSE_TIMEOUT,
        "generation": {"max-examples": EXAMPLES_PER_OPERATION, "database": "none"},
    })
    return schemathesis.openapi.from_dict(document, config=config)


_ALWAYS_REFUSED = ("use_beam_search", "length_penalty", "audio", "prediction",
                   "web_search_options", "modalities", "suffix", "best_of", "custom_logit_processor",
                   "max_dynamic_patch", "min_dynamic_patch", "deep_research", "custom_params",
                   "return_routed_experts")
_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs", "regex", "ebnf", "json_schema")


def _clamp(body: dict, positive: bool) -> None:
    """Keep each generation short: the fuzzer is after the request path, not long decodes."""
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # the default would be "the rest of the context"
    for key in ("n", "best_of"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_N:
            body[key] = MAX_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
        body["prompt"] = prompt[:MAX_PROMPTS]
    if positive:
        # Valid by the schema, but refused by design on every request: drop them so that valid
        # bodies reach sampling, constraints and generation instead of stopping at the first check.
        for key in _ALWAYS_REFUSED:
            body.pop(key, None)
        for key in [k for k in body if k in _CONSTRAINT_FIELDS][1:]:
            del body[key]  # more than one structured-output constraint is a 400 by design
        if body.get("messages") == []:
            body["messages"] = [{"role": "user", "content": "hi"}]  # an empty list stops at the first check
        if isinstance(body.get("model"), str):
            body["model"] = MODEL  # otherwise almost every valid body stops at 404 unknown model


def _error_contract_problem(response) -> str | None:
    """Why a 4xx answer breaks the error contract (full body, request id mirrored), or None."""
    if response.status_code < 400:
        return None
    request_id = response.headers.get("x-request-id")
    if isinstance(request_id, list):
        request_id = request_id[0]
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} body is not JSON: {response.content[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error", "code", "message", "request_id"}:
        return f"{response.status_code} body keys: {sorted(body) if isinstance(body, dict) else type(body)}"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"{response.status_code} error keys: {error}"
    if body["code"] != error["code"] or body["message"] != error["message"]:
        return f"{response.status_code} top-level code/message differ from error: {body}"
    if body["request_id"] != request_id:
        return f"{response.status_code} request_id {body['request_id']!r} != header {request_id!r}"
    return None


def test_live_document_lists_the_same_operations(api_schema):
    live = sorted(result.ok().label for result in api_schema.get_all_operations())
    assert live == OPERATIONS


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz_operation(api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label
    has_input = bool(operation.body) or any(True for _ in operation.iter_parameters())
    if mode is GenerationMode.NEGATIVE and not has_input:
        pytest.skip("nothing to break: the operation takes no parameters and no body")
    positive = mode is GenerationMode.POSITIVE

    @settings(
        deadline=None,
        max_examples=EXAMPLES_PER_OPERATION,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same cases every run
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        if isinstance(case.body, dict):
            _clamp(case.body, positive)
        started = time.monotonic()
        response = case.call(timeout=RESPONSE_TIMEOUT)
        assert time.monotonic() - started < RESPONSE_TIMEOUT
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error])
        problem = _error_contract_problem(response)
        if problem and len(contract_problems) < 5:
            contract_problems.append(problem)

    statuses: dict[int, int] = {}
    contract_problems: list[str] = []
    try:
        fuzz()  # stops at the first 5xx or hang
    except Unsatisfiable:  # e.g. only a free-form string path parameter: no invalid value exists
        assert not positive, label
        pytest.skip("no invalid input exists for this operation")
    print(f"{label} {mode.value}: statuses {dict(sorted(statuses.items()))}")
    # Contract problems are collected rather than raised, so that they never stop the hunt for 5xx.
    assert not contract_problems, "\n".join(contract_problems)


def test_alive_and_idle_after_fuzzing(tiny_server):
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(tiny_server.base_url + "/health", timeout=30)
        assert health.status_code == 200, health.text
        state = health.json()
        if state.get("running") == 0 and state.get("waiting") == 0:
            break
        assert time.monotonic() < deadline, f"engine still busy after fuzzing: {state}"
        time.sleep(0.1)
    assert_alive(tiny_server)
