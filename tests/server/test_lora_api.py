"""LoRA adapters through the OpenAI SDK against a real server: names, errors, and equality with the
adapter merged into the weights."""

from __future__ import annotations

import openai
import pytest

from server.config import Settings
from server.model_loader import ModelSource
from tests.conftest import start_server
from tests.server.lora_util import make_adapter

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-api")
    make_adapter(tiny_model_dir, root / "sql", seed=11, merged_dir=root / "sql-merged")
    make_adapter(tiny_model_dir, root / "poet", seed=12, targets=["q_proj", "o_proj", "up_proj"], rank=2)
    return root


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, lora_dirs):
    modules = f"sql={lora_dirs / 'sql'},poet={lora_dirs / 'poet'}"
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_batch_size=8, max_model_len=1024,
                        lora_modules=modules)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name="tiny"))
    yield running
    stop()


@pytest.fixture(scope="module")
def merged_server(lora_dirs):
    directory = lora_dirs / "sql-merged"
    settings = Settings(model=str(directory), served_model_name="tiny", max_batch_size=4, max_model_len=1024)
    running, stop = start_server(settings, ModelSource(directory, name="tiny"))
    yield running
    stop()


def complete(client, model: str, **extra) -> str:
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0,
                                      extra_body={"ignore_eos": True, **extra})
    return reply.choices[0].text


def test_adapter_output_differs_from_base_and_equals_merged_model(lora_server, merged_server):
    client = lora_server.client()
    base = complete(client, "tiny")
    by_name = complete(client, "sql")  # vLLM: the adapter's name
    by_base_colon = complete(client, "tiny:sql")  # SGLang: base:adapter
    by_lora_path = complete(client, "tiny", lora_path="sql")  # SGLang: lora_path
    merged = complete(merged_server.client(), "tiny")
    assert by_name == by_base_colon == by_lora_path == merged
    assert by_name != base


def test_chat_with_adapter_equals_merged_model(lora_server, merged_server):
    def chat(client, model):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                               max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    assert chat(lora_server.client(), "tiny:sql") == chat(merged_server.client(), "tiny")


def test_concurrent_requests_on_different_adapters_equal_their_solo_runs(lora_server):
    from concurrent.futures import ThreadPoolExecutor

    client = lora_server.client()
    models = ["tiny", "sql", "poet"]
    solo = {model: complete(client, model) for model in models}
    assert len(set(solo.values())) == 3
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda m: (m, complete(client, m)), models * 2))
    for model, text in together:
        assert text == solo[model]


def test_models_list_adapters_with_parent(lora_server, lora_dirs):
    cards = {card.id: card for card in lora_server.client().models.list().data}
    assert set(cards) == {"tiny", "sql", "poet"}
    assert cards["sql"].parent == "tiny" and cards["tiny"].parent is None
    assert cards["poet"].root == str(lora_dirs / "poet")


def test_responses_name_the_adapter_that_ran(lora_server):
    """vLLM echoes the adapter's name, SGLang the request's ``base:adapter``; ``lora_path`` reports
    ``base:adapter``; the base model (also as ``name@provider``) reports the served name."""
    client = lora_server.client()
    cases = {("sql", None): "sql", ("tiny:sql", None): "tiny:sql", ("tiny", "poet"): "tiny:poet",
             ("tiny", None): "tiny", ("tiny@trellis", None): "tiny", ("sql@trellis", None): "sql"}
    for (model, lora_path), reported in cases.items():
        extra = {"lora_path": lora_path} if lora_path else {}
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert reply.model == reported, (model, lora_path)
    chat = client.chat.completions.create(model="tiny:poet", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, stream=True)
    assert {chunk.model for chunk in chat} == {"tiny:poet"}


def test_router_endpoints_list_adapters(lora_server):
    import httpx

    endpoints = httpx.get(lora_server.base_url + "/v0/endpoints").json()
    assert endpoints == ["tiny@trellis", "sql@trellis", "poet@trellis"]
    reply = httpx.post(lora_server.base_url + "/v0/completions", timeout=60,
                       json={"model": "poet@trellis", "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["model"] == "poet"


def test_unknown_adapters_are_named(lora_server):
    client = lora_server.client()
    with pytest.raises(openai.NotFoundError, match="nosuch"):
        complete(client, "tiny:nosuch")
    with pytest.raises(openai.NotFoundError, match="other"):
        complete(client, "other")
    with pytest.raises(openai.BadRequestError, match="nosuch") as info:
        complete(client, "tiny", lora_path="nosuch")
    assert info.value.body["param"] == "lora_path"
    with pytest.raises(openai.BadRequestError, match="poet"):
        complete(client, "sql", lora_path="poet")


def test_lora_path_without_adapters_is_refused(tiny_server):
    with pytest.raises(openai.BadRequestError, match="--lora-modules"):
        complete(tiny_server.client(), "tiny", lora_path="sql")


def test_streamed_adapter_output_equals_non_streamed(lora_server):
    client = lora_server.client()
    stream = client.completions.create(model="tiny:poet", prompt=PROMPT, max_tokens=16, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == complete(client, "poet")


def test_bad_adapter_stops_start_up_with_one_line(tiny_model_dir, tmp_path, capsys):
    import json
    import shutil

    from server.cli import main

    directory = tmp_path / "dora"
    make_adapter(tiny_model_dir, directory, seed=3)
    config = json.loads((directory / "adapter_config.json").read_text())
    config["use_dora"] = True
    (directory / "adapter_config.json").write_text(json.dumps(config))
    assert main(["serve", "--model", str(tiny_model_dir), "--lora-modules", f"d={directory}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line.startswith("trellis: error:") and "DoRA" in line for line in err)
    shutil.rmtree(directory)
