"""Reasoning models end to end: free to think, strict to answer.

Tiny random-weight Llamas carry minimal templates of the two reasoning families, written here:
a Qwen3-style ``<think>`` template and a harmony-style (gpt-oss) template. A random model never
ends its reasoning on its own, so budgets (or a logit bias on ``</think>``) end it; what is checked
is the server's part: the reasoning is free, the answer after it is constrained and valid.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from server.chat import prepare_chat
from server.config import Settings
from server.model_loader import ModelSource, load_tokenizer
from server.reasoning import (
    RESEARCH_PROMPT,
    ReasoningStreamSplitter,
    detect_reasoning,
    prompt_state,
    split_reasoning,
)
from tests.conftest import start_server

# Qwen3-style: ChatML turns; the answer follows <think>…</think>; enable_thinking=false pre-fills an
# empty "<think>\n\n</think>\n\n" (format as described in the Qwen3 model card, "Switching Between
# Thinking and Non-Thinking Mode"). Tools are listed in the system turn, Hermes-style.
THINK_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)

# harmony-style (format: https://cookbook.openai.com/articles/openai-harmony): the system message
# carries "Reasoning: <effort>"; every message is <|start|>role<|channel|>…<|message|>…<|end|>; the
# generation prompt is "<|start|>assistant" and the model picks its channel (analysis, then final).
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                       "additionalProperties": False},
    },
}
MESSAGES = [{"role": "user", "content": "Is it raining?"}]


def _model_dir(tmp_path_factory, default_tokenizer, name: str, template: str, special: list[str]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp(name)
    tokenizer = load_tokenizer_copy(default_tokenizer)
    tokenizer.add_tokens(special, special_tokens=True)
    tokenizer.chat_template = template
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tokenizer_copy(tokenizer):
    import copy

    return copy.deepcopy(tokenizer)


def _serve(directory, name, **options):
    settings = Settings(model=str(directory), served_model_name=name, max_batch_size=4, max_model_len=2048,
                        compile_workers=1, **options)
    return start_server(settings, ModelSource(directory, name=name))


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory, default_tokenizer):
    return _model_dir(tmp_path_factory, default_tokenizer, "tiny-think", THINK_TEMPLATE, ["<think>", "</think>"])


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, default_tokenizer):
    specials = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
    return _model_dir(tmp_path_factory, default_tokenizer, "tiny-harmony", HARMONY_TEMPLATE, specials)


@pytest.fixture(scope="module")
def think_server(think_dir):
    running, stop = _serve(think_dir, "think")
    yield running
    stop()


@pytest.fixture(scope="module")
def harmony_server(harmony_dir):
    running, stop = _serve(harmony_dir, "harmony")
    yield running
    stop()


def json_format(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def prepared(server, **body):
    """The chat job the server would run for ``body`` (real prepare path, no generation)."""
    payload = {"model": server.settings.served_model_name, "messages": MESSAGES, **body}
    return asyncio.run(prepare_chat(server.state, json.dumps(payload).encode()))


def prompt_text(server, job) -> str:
    return server.state.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)


# --------------------------------------------------------------------------- detection and splitting


def test_detection_per_family(default_tokenizer, think_dir, harmony_dir):
    assert detect_reasoning(default_tokenizer) is None  # the default model: no reasoning
    think = detect_reasoning(load_tokenizer(think_dir))
    assert think is not None and think.family == "think" and think.reads_enable_thinking
    harmony = detect_reasoning(load_tokenizer(harmony_dir))
    assert harmony is not None and harmony.family == "harmony" and harmony.reads_effort
    assert not think.reads_effort


def test_prompt_state_open_closed_or_left_to_the_model(think_dir):
    tokenizer = load_tokenizer(think_dir)
    fmt = detect_reasoning(tokenizer)

    def state(suffix: str) -> str:
        ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + suffix,
                               add_special_tokens=False)
        return prompt_state(fmt, tokenizer, ids)

    assert state("") == "model"
    assert state("<think>\n") == "open"  # DeepSeek-R1 style pre-fill
    assert state("<think>\n\n</think>\n\n") == "closed"  # Qwen3 with enable_thinking=false


def test_end_marker_text_is_matched_where_the_tokenizer_splits_it(think_dir, default_tokenizer):
    """The engine matches ``</think>`` as text only where it is no single token (the default
    tokenizer splits it; the think model's tokenizer has it as a special token)."""
    from server.reasoning import ReasoningSetup, engine_phase

    own = load_tokenizer(think_dir)
    fmt = detect_reasoning(own)
    for tokenizer, text in ((own, ""), (default_tokenizer, "</think>")):
        phase = engine_phase(ReasoningSetup(fmt, "model", None), tokenizer, constrained=True)
        assert phase.end_text == text


@pytest.mark.parametrize("starts_inside, text, expected", [
    (False, "<think>\nhmm</think>\n\n{\"a\": 1}", ("\nhmm", "{\"a\": 1}")),
    (True, "hmm</think>answer", ("hmm", "answer")),
    (False, "plain answer", ("", "plain answer")),
    (True, "still thinking", ("still thinking", "")),
])
def test_split_think(think_dir, starts_inside, text, expected):
    fmt = detect_reasoning(load_tokenizer(think_dir))
    assert split_reasoning(text, fmt, starts_inside) == expected


def test_split_harmony(harmony_dir):
    fmt = detect_reasoning(load_tokenizer(harmony_dir))
    text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>{\"x\": 1}"
    assert split_reasoning(text, fmt, False) == ("think", "{\"x\": 1}")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_stream_splitter_matches_whole_split_whatever_the_chunks(think_dir, harmony_dir, size):
    cases = [
        (think_dir, False, "  <think>\nstep one</think>\n\n{\"answer\": \"yes\"}"),
        (think_dir, True, "a < b </thin</think>done"),
        (think_dir, False, "<thank you"),
        (harmony_dir, False, "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>ok"),
    ]
    for directory, inside, text in cases:
        fmt = detect_reasoning(load_tokenizer(directory))
        splitter = ReasoningStreamSplitter(fmt, inside)
        reasoning = content = ""
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        for i, chunk in enumerate(chunks):
            r, c = splitter.feed(chunk, final=i == len(chunks) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == split_reasoning(text, fmt, inside), (text, size)


# --------------------------------------------------------------------------- switches


def test_enable_thinking_false_renders_the_no_think_form(think_server):
    job = prepared(think_server, enable_thinking=False, response_format=json_format())
    assert prompt_text(think_server, job).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert job.reasoning is None and job.specs[0].reasoning is None  # constrained from the first token
    same = prepared(think_server, chat_template_kwargs={"enable_thinking": False})
    assert same.prompt_ids == job.prompt_ids
    thinking = prepared(think_server, response_format=json_format())
    assert prompt_text(think_server, thinking).endswith("<|im_start|>assistant\n")
    assert thinking.specs[0].reasoning is not None


def test_enable_thinking_false_answer_is_plain_json(think_server):
    client = think_server.client()
    reply = client.chat.completions.create(model="think", messages=MESSAGES, max_completion_tokens=60, seed=1,
                                           response_format=json_format(), extra_body={"enable_thinking": False})
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_effort_reaches_a_template_that_reads_it(harmony_server):
    job = prepared(harmony_server, reasoning_effort="high")
    assert "Reasoning: high" in prompt_text(harmony_server, job)
    assert "Reasoning: medium" in prompt_text(harmony_server, prepared(harmony_server))


def test_reasoning_switches_on_the_default_model_are_accepted_and_named(tiny_server):
    client = tiny_server.client()
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=4, reasoning_effort="high",
        extra_body={"max_reasoning_tokens": 16})
    assert raw.headers["x-trellis-ignored"] == "reasoning_effort,max_reasoning_tokens"
    reply = raw.parse()
    assert reply.choices[0].message.content is not None
    body = httpx.post(tiny_server.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).json()
    assert "reasoning_content" not in body["choices"][0]["message"]  # unchanged for a model without reasoning


def test_reasoning_effort_on_a_template_without_it_is_named(think_server):
    raw = think_server.client().chat.completions.with_raw_response.create(
        model="think", messages=MESSAGES, max_tokens=3, reasoning_effort="low")
    assert raw.headers["x-trellis-ignored"] == "reasoning_effort"


def test_conflicting_budgets_are_a_400(think_server):
    response = httpx.post(think_server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "think", "messages": MESSAGES, "max_reasoning_tokens": 4, "thinking_budget": 5})
    assert response.status_code == 400
    assert response.json()["error"]["param"] in ("max_reasoning_tokens", "thinking_budget")


# --------------------------------------------------------------------------- free to think, strict to answer


def _tokens(reply) -> list[str]:
    return [entry.token for entry in reply.choices[0].logprobs.content]


def test_budget_reached_then_a_valid_json_answer(think_server):
    client = think_server.client()
    reply = client.chat.completions.create(
        model="think", messages=MESSAGES, max_completion_tokens=80, seed=3, logprobs=True,
        response_format=json_format(), extra_body={"max_reasoning_tokens": 12})
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)  # the whole answer after </think>
    assert message.reasoning_content
    tokens = _tokens(reply)
    assert tokens[0] == "<think>"  # the model did not open it: the engine did
    assert tokens.index("</think>") == 1 + 12  # exactly the budget of free reasoning tokens
    assert reply.usage.completion_tokens == len(tokens) <= 80  # reasoning and answer share the budget
    assert reply.choices[0].finish_reason == "stop"


def test_natural_end_of_reasoning_then_a_valid_json_answer(think_server, think_dir):
    end_id = load_tokenizer(think_dir).convert_tokens_to_ids("</think>")
    reply = think_server.client().chat.completions.create(
        model="think", messages=MESSAGES, max_completion_tokens=60, seed=4, logprobs=True,
        response_format=json_format(), logit_bias={str(end_id): 100})
    tokens = _tokens(reply)
    assert tokens[:2] == ["<think>", "</think>"]  # sampled, not forced: no budget was given
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_streamed_reasoning_then_json_assembles_to_the_same_answer(think_server):
    client = think_server.client()
    fields = dict(model="think", messages=MESSAGES, max_completion_tokens=80, seed=8,
                  response_format=json_format(), extra_body={"thinking_token_budget": 10})
    whole = client.chat.completions.create(**fields).choices[0].message
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **fields):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    jsonschema.validate(json.loads(content), SCHEMA)
    assert "</think>" not in content and "<think>" not in reasoning


def test_reasoning_then_a_required_tool_call(think_server):
    reply = think_server.client().chat.completions.create(
        model="think", messages=MESSAGES, max_completion_tokens=120, seed=5, tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, extra_body={"thinking_budget": 8})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_harmony_analysis_then_final_json(harmony_server):
    reply = harmony_server.client().chat.completions.create(
        model="harmony", messages=MESSAGES, max_completion_tokens=80, seed=6, logprobs=True,
        response_format=json_format(), reasoning_effort="low", extra_body={"max_reasoning_tokens": 6})
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert message.reasoning_content is not None
    tokens = _tokens(reply)
    header = ["<|channel|>", "analysis", "<|message|>"]
    assert tokens[: len(header)] == header
    cut = len(header) + 6
    assert tokens[cut] == "<|end|>"  # forced at the budget, then the final channel's header
    assert "".join(tokens[cut:]).startswith("<|end|><|start|>assistant<|channel|>final<|message|>{")


# DeepSeek-R1-style: the generation prompt pre-fills "<think>\n" (the segment is open in the prompt).
PREFILLED_TEMPLATE = THINK_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n", 1)


def test_prefilled_think_is_not_opened_twice(think_server):
    assert PREFILLED_TEMPLATE != THINK_TEMPLATE
    reply = think_server.client().chat.completions.create(
        model="think", messages=MESSAGES, max_completion_tokens=60, seed=2, logprobs=True,
        response_format=json_format(), extra_body={"chat_template": PREFILLED_TEMPLATE, "max_reasoning_tokens": 5})
    tokens = _tokens(reply)
    assert "<think>" not in tokens and tokens.index("</think>") == 5
    message = reply.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert message.reasoning_content and "<think>" not in message.reasoning_content


# --------------------------------------------------------------------------- deep research


def test_deep_research_thinks_with_a_research_prompt_and_keeps_the_tools(think_server):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    plain = prepared(think_server, enable_thinking=False, tools=tools)
    job = prepared(think_server, deep_research=True, tools=tools)
    text = prompt_text(think_server, job)
    assert RESEARCH_PROMPT in text and RESEARCH_PROMPT not in prompt_text(think_server, plain)
    assert '"search"' in text  # the request's tools are still offered
    assert job.reasoning is not None  # thinking is on: the model reasons before it answers
    assert job.tool_plan is not None


def test_deep_research_must_be_a_boolean(think_server):
    reply = httpx.post(f"{think_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": think_server.settings.served_model_name, "messages": MESSAGES, "deep_research": "yes"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "deep_research"


@pytest.fixture(scope="module")
def harmony_tools_server(harmony_dir):
    running, stop = _serve(harmony_dir, "harmony", tool_call_format="gpt-oss")
    yield running
    stop()


def test_harmony_reasoning_then_a_required_call_on_the_commentary_channel(harmony_tools_server):
    reply = harmony_tools_server.client().chat.completions.create(
        model="harmony", messages=MESSAGES, max_completion_tokens=120, seed=5, tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, logprobs=True, extra_body={"max_reasoning_tokens": 6})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    text = "".join(_tokens(reply))
    assert "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather" in text
    assert "final" not in text.split("<|end|>", 1)[1]  # the answer is the call, not a final message

