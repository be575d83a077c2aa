"""Images and video over the API with the `openai` client: the real server (engine core in its own process) serving
the tiny dense-vl checkpoint on the CPU. A base64 image and a video file answer with the same tokens as the offline
engine gives for the same media, streamed and not, and an input_image through /v1/responses as through chat;
--limit-mm-per-prompt and bad media (corrupt bytes, a wrong MIME type, a huge image, a path outside
--allowed-local-media-path, a remote URL) get a 400 in vLLM's envelope, and the server stays up; a text-only server
(--language-model-only) refuses media parts with a 400."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.llm import LLM
from deltaserve.engine_config import EngineConfig
from deltaserve.sampling_params import SamplingParams
from tests.multimodal.synthetic import synthetic_image, synthetic_video
from tests.multimodal.test_media import write_video
from tests.support.vision import tiny_vision_checkpoint

from .server_thread import ServerThread, serve

MAX_TOKENS = 6


def part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def b64_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_data_url(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    write_video(folder / "clip.mkv", synthetic_video(6, 64, 96, seed=4), fps=3)
    return folder


def serve_model(model: Path, **engine: object) -> ServerThread:
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", max_model_len=1024, **engine)
    return serve(AsyncEngine.from_config(config), model_root=str(model), served_model_names=["vl"])


@pytest.fixture(scope="module")
def server(media_dir: Path) -> Iterator[ServerThread]:
    thread = serve_model(tiny_vision_checkpoint("dense-vl"), allowed_local_media_path=str(media_dir),
                   limit_mm_per_prompt='{"image": 2, "video": 1}')  # fmt: skip
    yield thread
    thread.stop()


def chat(server: ServerThread, content: list[dict], stream: bool = False) -> list[int] | str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": content}]
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True, "return_token_ids": False}
    if not stream:
        reply = client.chat.completions.create(model="vl", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=extra)  # fmt: skip
        return reply.choices[0].message.content
    pieces = client.chat.completions.create(model="vl", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body=extra)  # fmt: skip
    return "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)


def offline_text(content: list[dict], media: dict) -> str:
    llm = LLM(tiny_vision_checkpoint("dense-vl"), dtype="float32", max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    parts = [{"type": p["type"].removesuffix("_url")} if p["type"] != "text" else p for p in content]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt": text, "multi_modal_data": media}], params, use_tqdm=False)
    return out.outputs[0].text


def test_a_base64_image_streamed_and_not_equals_the_offline_engine(server: ServerThread) -> None:
    pixels = synthetic_image(80, 112, seed=3)
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": png_data_url(pixels)}},
    ]
    expected = offline_text(content, {"image": pixels})
    assert chat(server, content) == expected
    assert chat(server, content, stream=True) == expected


def test_an_input_image_through_the_responses_api_answers_as_chat_does(server: ServerThread) -> None:
    url = png_data_url(synthetic_image(80, 112, seed=3))
    expected = chat(server, [{"type": "text", "text": "What is this?"}, part(url)])
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    items = [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]
    reply = client.responses.create(model="vl", input=[{"role": "user", "content": items}], temperature=0,
                                    max_output_tokens=MAX_TOKENS, reasoning={"effort": "none"},
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.output_text == expected and reply.usage.output_tokens == MAX_TOKENS


def test_a_video_file_under_the_allowed_folder(server: ServerThread, media_dir: Path) -> None:
    content = [{"type": "video_url", "video_url": {"url": f"file://{media_dir}/clip.mkv"}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    text = chat(server, content)
    assert isinstance(text, str) and text == chat(server, content, stream=True)


def _status(server: ServerThread, content: list[dict]) -> httpx.Response:
    body = {"model": "vl", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("case", "bad"),
    [
        ("corrupt bytes", part(b64_url("image/png", b"not a png"))),
        ("wrong MIME", part(b64_url("text/plain", b"hello"))),
        ("huge image", part(png_data_url(np.zeros((12000, 12000, 3), np.uint8)))),
        ("outside the allowed folder", part("file:///etc/passwd")),
        ("remote URL", part("http://example.com/cat.png")),
        ("too many images", None),
    ],
)  # fmt: skip
def test_bad_media_is_a_400_and_the_server_stays_up(server: ServerThread, case: str, bad: dict | None) -> None:
    url = png_data_url(synthetic_image(32, 32))
    content = [part(url)] * 3 if bad is None else [bad]
    response = _status(server, content)
    assert response.status_code == 400, (case, response.text)
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    if bad is None:
        assert "At most 2 image(s)" in error["message"]
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_a_text_only_server_refuses_media_parts() -> None:
    thread = serve_model(tiny_vision_checkpoint("dense-vl"), language_model_only=True)
    try:
        response = _status(thread, [{"type": "image_url", "image_url": {"url": png_data_url(synthetic_image(32, 32))}}])
        assert response.status_code == 400 and "text only" in response.json()["error"]["message"]
    finally:
        thread.stop()
