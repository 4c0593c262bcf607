"""Images through the HTTP API, with the ``openai`` SDK as the client, on a tiny random-weight
Qwen2-VL: data-URL images in user messages generate; json_schema output over an image is valid
JSON; ``n`` > 1 and streaming work; usage counts the image tokens; every bad image part is a 400
naming the part; a text-only model refuses image parts."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest

from server.config import Settings
from server.model_loader import ModelSource
from tests.conftest import start_server
from tests.server.engine.vision.tiny_vlm import write_qwen2_vl


def _data_url(width=100, height=80, color=(200, 30, 40), fmt="PNG") -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def _image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


TEXT = {"type": "text", "text": "What is in the picture?"}


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, default_tokenizer):
    directory = write_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"), default_tokenizer)
    settings = Settings(model=str(directory), served_model_name="tiny-vl", max_batch_size=4, max_model_len=1024,
                        limit_mm_per_prompt="image=3")
    running, stop = start_server(settings, ModelSource(directory, name="tiny-vl"))
    yield running
    stop()


def test_an_image_prompt_generates_and_counts_its_image_tokens(vlm_server):
    client = vlm_server.client()
    text_only = client.chat.completions.create(model="tiny-vl", messages=_user(TEXT), max_tokens=4, temperature=0)
    with_image = client.chat.completions.create(model="tiny-vl", messages=_user(_image(_data_url()), TEXT),
                                                max_tokens=4, temperature=0)
    assert with_image.choices[0].finish_reason == "length"
    # 100x80 -> a 6x8 patch grid after resizing to multiples of 28 -> 12 merged tokens, plus the two markers
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens + 10
    two = client.chat.completions.create(
        model="tiny-vl", messages=_user(_image(_data_url(color=(0, 0, 255))), _image(_data_url(60, 60)), TEXT),
        max_tokens=4, temperature=0)
    assert two.usage.prompt_tokens > with_image.usage.prompt_tokens


def test_json_schema_over_an_image_is_valid_json(vlm_server):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    reply = vlm_server.client().chat.completions.create(
        model="tiny-vl", messages=_user(_image(_data_url()), TEXT), max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "picture", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"colour", "count"} and 0 <= value["count"] <= 9


def test_n_choices_and_streaming_over_an_image(vlm_server):
    client = vlm_server.client()
    messages = _user(_image(_data_url(color=(10, 200, 10))), TEXT)
    reply = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=5, temperature=0, n=2)
    assert len(reply.choices) == 2 and reply.choices[0].message.content == reply.choices[1].message.content
    stream = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=5, temperature=0,
                                            stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == reply.choices[0].message.content


def test_the_same_image_resent_is_served_from_the_cache(vlm_server):
    client = vlm_server.client()
    messages = _user(_image(_data_url(90, 90, (1, 2, 3))), TEXT)
    first = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"return_cached_tokens_details": True})
    again = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"return_cached_tokens_details": True})
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("part, param, words", [
    (_image("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[0].image_url.url", "image"),
    (_image("https://example.com/cat.png"), "messages[0].content[0].image_url.url", "--allowed-media-domains"),
    (_image(_data_url(), detail="ultra"), "messages[0].content[0].image_url.detail", "detail"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "messages[0].content[0]", "images only"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages[0].content[0]",
     "images only"),
])
def test_a_bad_image_part_is_a_400_naming_it(vlm_server, part, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_server.client().chat.completions.create(model="tiny-vl", messages=_user(part, TEXT), max_tokens=2)
    error = caught.value.body
    assert error["param"] == param and words in error["message"]


def test_more_images_than_the_limit_is_a_400(vlm_server):
    parts = [_image(_data_url(30, 30)) for _ in range(4)]
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_server.client().chat.completions.create(model="tiny-vl", messages=_user(*parts, TEXT), max_tokens=2)
    assert "at most 3" in caught.value.body["message"]


def test_an_image_outside_a_user_message_is_a_400(vlm_server):
    messages = [{"role": "system", "content": [_image(_data_url())]}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_server.client().chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
    assert "user messages" in caught.value.body["message"]


def test_a_text_only_model_refuses_image_parts(tiny_server):
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_server.client().chat.completions.create(model="tiny", messages=_user(_image(_data_url()), TEXT),
                                                     max_tokens=2)
    assert "text-only" in caught.value.body["message"]


def test_regex_choice_and_a_forced_tool_call_over_an_image(vlm_server):
    client = vlm_server.client()
    messages = _user(_image(_data_url(color=(9, 9, 9))), TEXT)
    regex = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(regex.choices[0].message.content) == 6 and regex.choices[0].message.content[3] == "-"
    choice = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"guided_choice": ["receipt", "invoice", "form"]})
    assert choice.choices[0].message.content in ("receipt", "invoice", "form")
    tool = {"type": "function", "function": {"name": "record_total", "parameters": {
        "type": "object", "properties": {"total": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["total"], "additionalProperties": False}}}
    called = client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=40, temperature=0,
                                            tools=[tool], tool_choice="required")
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "record_total" and "total" in json.loads(call.function.arguments)


@pytest.mark.parametrize("field", ["max_dynamic_patch", "min_dynamic_patch"])
def test_tile_counts_on_a_model_that_does_not_tile_are_a_400(vlm_server, field):
    with pytest.raises(openai.BadRequestError) as caught:
        vlm_server.client().chat.completions.create(model="tiny-vl", messages=_user(_image(_data_url()), TEXT),
                                                    max_tokens=2, extra_body={field: 4})
    assert caught.value.body["param"] == field and "does not cut images into tiles" in caught.value.body["message"]


@pytest.fixture(scope="module")
def tiling_server(tmp_path_factory, default_tokenizer):
    """A tiny SmolVLM: its processor cuts images into tiles."""
    from tests.server.engine.vision.tiny_vlm import write_idefics3

    directory = write_idefics3(tmp_path_factory.mktemp("smolvlm"), default_tokenizer, "smolvlm")
    settings = Settings(model=str(directory), served_model_name="tiny-smol", max_batch_size=4, max_model_len=2048)
    running, stop = start_server(settings, ModelSource(directory, name="tiny-smol"))
    yield running
    stop()


def test_a_tiling_model_takes_max_dynamic_patch_and_detail(tiling_server):
    client = tiling_server.client()
    messages = _user(_image(_data_url(200, 150)), TEXT)

    def prompt_tokens(**extra) -> int:
        reply = client.chat.completions.create(model="tiny-smol", messages=messages, max_tokens=2, temperature=0,
                                               extra_body=extra)
        return reply.usage.prompt_tokens

    tiled, capped, global_only = prompt_tokens(), prompt_tokens(max_dynamic_patch=1), prompt_tokens(
        messages=[{"role": "user", "content": [_image(_data_url(200, 150), detail="low"), TEXT]}])
    assert tiled > capped and capped == global_only
    with pytest.raises(openai.BadRequestError) as caught:
        prompt_tokens(min_dynamic_patch=2)
    assert caught.value.body["param"] == "min_dynamic_patch"


def test_the_router_dialect_keeps_image_parts(vlm_server):
    import httpx

    body = {"model": "tiny-vl@trellis", "messages": _user(_image(_data_url(color=(5, 6, 7))), TEXT), "max_tokens": 3,
            "temperature": 0, "unknown_knob": 1}
    v0 = httpx.post(vlm_server.base_url + "/v0/chat/completions", json=body, timeout=60)
    assert v0.status_code == 200, v0.text
    assert v0.headers["x-trellis-dropped-params"] == "unknown_knob"
    v1 = vlm_server.client().chat.completions.create(model="tiny-vl", messages=body["messages"], max_tokens=3,
                                                     temperature=0)
    assert v0.json()["usage"]["prompt_tokens"] == v1.usage.prompt_tokens
    assert v0.json()["choices"][0]["message"]["content"] == v1.choices[0].message.content


def test_a_stored_completion_keeps_its_image_as_a_reference(vlm_server):
    import httpx

    url = _data_url(40, 40, (77, 66, 55))
    reply = vlm_server.client().chat.completions.create(model="tiny-vl", messages=_user(_image(url), TEXT),
                                                        max_tokens=2, temperature=0, store=True)
    stored = httpx.get(f"{vlm_server.base_url}/v1/chat/completions/{reply.id}/messages", timeout=30)
    assert stored.status_code == 200, stored.text
    [message] = stored.json()["data"]
    [image, text] = message["content_parts"]
    assert image["image_url"]["url"].startswith("trellis-image:sha256:") and text["text"] == TEXT["text"]
    assert "base64" not in stored.text


def test_metrics_count_image_bytes_and_preprocessing_time(vlm_server):
    import httpx

    def scrape() -> dict[str, float]:
        text = httpx.get(vlm_server.base_url + "/metrics", timeout=30).text
        wanted = ("trellis_image_bytes_total", "trellis_image_preprocess_seconds_count")
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(wanted)}

    before = scrape()
    url = _data_url(64, 64, (1, 1, 1))
    vlm_server.client().chat.completions.create(model="tiny-vl", messages=_user(_image(url), TEXT), max_tokens=1)
    after = scrape()
    encoded = len(base64.b64decode(url.split(",", 1)[1]))
    assert after["trellis_image_bytes_total"] - before.get("trellis_image_bytes_total", 0) == encoded
    assert after["trellis_image_preprocess_seconds_count"] == before.get("trellis_image_preprocess_seconds_count", 0) + 1
