"""SGLang's ``custom_logit_processor`` through the OpenAI SDK: run behind the opt-in flag, per request,
inside the batched sampler pass; a broken processor fails only its own request; refused without the flag.

The processors are serialized the way an SGLang client does (``CustomLogitProcessor.to_str()``: a
dill-pickled class, hex in JSON) by a separate Python process whose ``__main__`` defines them, so the
server cannot import them and must run the pickled code itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server.config import Settings
from server.model_loader import ModelSource
from tests.conftest import start_server

CLIENT_SCRIPT = r'''
import json, dill

class ForceToken:
    """Every step, only custom_params["token_id"] is possible."""
    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            logits[i, :] = -float("inf")
            logits[i, params["token_id"]] = 0.0
        return logits

class Broken:
    def __call__(self, logits, custom_param_list=None):
        raise RuntimeError("processor bug")

class WrongShape:
    def __call__(self, logits, custom_param_list=None):
        return logits[:, :10]

def to_str(cls):  # SGLang's CustomLogitProcessor.to_str()
    return json.dumps({"callable": dill.dumps(cls).hex()})

print(json.dumps({name: to_str(cls) for name, cls in
                  [("force", ForceToken), ("broken", Broken), ("wrong_shape", WrongShape)]}))
'''


@pytest.fixture(scope="module")
def processors() -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_batch_size=8, max_model_len=1024,
                        enable_custom_logit_processor=True)
    running, stop = start_server(settings, ModelSource(tiny_model_dir, name="tiny"))
    yield running
    stop()


def token_id(server, text: str) -> int:
    ids = server.state.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def complete(client, **extra):
    return client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0.0,
                                     extra_body={"ignore_eos": True, **extra})


def test_processor_forces_the_token_its_params_name(server, processors):
    client = server.client()
    plain = complete(client).choices[0].text
    for word in (" cat", " dog"):
        forced = complete(client, custom_logit_processor=processors["force"],
                          custom_params={"token_id": token_id(server, word)})
        assert forced.choices[0].text == word * 4
    assert plain != " cat" * 4


def test_chat_with_sampling_is_forced_too(server, processors):
    reply = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "custom_logit_processor": processors["force"],
                    "custom_params": {"token_id": token_id(server, " yes")}})
    assert reply.choices[0].message.content == " yes" * 3


def test_broken_processor_fails_only_its_own_request(server, processors):
    client = server.client()
    plain = complete(client).choices[0].text

    def run(kind: str):
        try:
            if kind == "plain":
                return complete(client).choices[0].text
            if kind == "force":
                return complete(client, custom_logit_processor=processors["force"],
                                custom_params={"token_id": token_id(server, " cat")}).choices[0].text
            complete(client, custom_logit_processor=processors[kind])
        except openai.BadRequestError as exc:
            return exc.body
        raise AssertionError(f"{kind} should have failed")

    kinds = ["plain", "broken", "force", "wrong_shape", "plain", "force"]
    with ThreadPoolExecutor(len(kinds)) as pool:
        results = dict(zip(range(len(kinds)), pool.map(run, kinds)))
    for i, kind in enumerate(kinds):
        if kind == "plain":
            assert results[i] == plain
        elif kind == "force":
            assert results[i] == " cat" * 4
        else:
            assert results[i]["param"] == "custom_logit_processor"
    assert "RuntimeError: processor bug" in results[1]["message"]
    assert "shape" in results[3]["message"]
    assert server.state.engine.alive


def test_broken_processor_in_a_stream_ends_with_an_error(server, processors):
    stream = server.client().completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True,
                                                extra_body={"custom_logit_processor": processors["broken"]})
    with pytest.raises(openai.APIError, match="processor bug"):
        for _ in stream:
            pass


def test_bad_payloads_are_400s_naming_the_field(server, processors):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, custom_logit_processor="{not json")
    assert info.value.body["param"] == "custom_logit_processor"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, custom_params={"token_id": 1})
    assert info.value.body["param"] == "custom_params"
    with pytest.raises(openai.BadRequestError) as info:  # scoring ranks raw probabilities: not steerable
        complete(client, custom_logit_processor=processors["force"], custom_params={"token_id": 1},
                 guided_choice=["yes", "no"], logprobs=1)
    assert info.value.body["param"] == "custom_logit_processor"


def test_refused_without_the_flag(tiny_server, processors):
    with pytest.raises(openai.BadRequestError) as info:
        complete(tiny_server.client(), custom_logit_processor=processors["force"], custom_params={"token_id": 1})
    assert info.value.body["param"] == "custom_logit_processor"
    assert "--enable-custom-logit-processor" in info.value.body["message"]
    dropped = httpx.post(tiny_server.base_url + "/v0/completions", timeout=60,
                         json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "custom_params": {"token_id": 1},
                               "custom_logit_processor": processors["force"]})
    assert dropped.status_code == 200, dropped.text
    assert set(dropped.headers["x-trellis-dropped-params"].split(",")) == {"custom_logit_processor", "custom_params"}
