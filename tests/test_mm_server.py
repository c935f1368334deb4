"""Chat image parts through `enginecore serve` and the official openai client:
base64 data URLs answer like LLM.chat; bad images are 400s naming the problem,
and the server keeps serving."""

import base64
import io

import openai
import pytest

from server_helpers import ServerProcess
from tiny_qwen2_vl import make_tiny_qwen2_vl, random_image


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen2vl-serve")))


@pytest.fixture(scope="module", params=["native", "python"])
def client(request, qwen_dir):
    srv = ServerProcess(
        [qwen_dir, "--served-model-name", "tiny-vl", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(32 << 20), "--dtype", "float32",
         "--limit-mm-per-prompt", '{"image": 1}'],
        env={"ENGINECORE_NATIVE": "1" if request.param == "native" else "0"})
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60) as c:
            yield c
    finally:
        srv.stop()


def data_url(payload: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(payload).decode()


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    random_image(56, 84, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def chat(client, *urls, text="what is it?"):
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": text})
    return client.chat.completions.create(
        model="tiny-vl", messages=[{"role": "user", "content": content}], max_tokens=4,
        temperature=0.0)


def test_image_chats_and_bad_images(client):
    first = chat(client, data_url(png(1)))
    assert first.choices[0].finish_reason == "length"
    assert chat(client, data_url(png(1))).choices[0].message.content == \
        first.choices[0].message.content  # the second one: the engine's cached item
    bad = {
        "cannot decode": [data_url(b"\x89PNG broken")],
        "unsupported image MIME type": [data_url(b"<svg/>", "image/svg+xml")],
        "At most 1 image": [data_url(png(1)), data_url(png(2))],
        "not allowed": ["https://example.com/cat.png"],
    }
    for match, urls in bad.items():
        with pytest.raises(openai.BadRequestError, match=match):
            chat(client, *urls)
    assert chat(client, data_url(png(3))).choices[0].finish_reason == "length"
