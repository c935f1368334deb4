"""Images end to end through the front-end (issue 21's acceptance): ``LLM.generate`` with
``multi_modal_data`` on tiny random Qwen2-VL and LLaVA models saved by transformers
gives transformers' greedy tokens, with one and with two images, on both paths. The
front-end's processing, the wire, the receiver cache, the encoder budget and cache,
the runner's embedding merge (and Qwen2-VL's M-RoPE) all take part."""

from __future__ import annotations

import pytest
import torch

from enginecore import LLM, SamplingParams
from test_mm_frontend import PAD, make_tiny_llava
from tiny_qwen2_vl import hf_generate, hf_inputs, make_tiny_qwen2_vl, random_image

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl-e2e")))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llava-e2e"))
    make_tiny_llava(path)
    return path


def llm_tokens(model_dir: str, prompt: str, images: list, hot_path: str) -> list[int]:
    llm = LLM(model_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              max_num_batched_tokens=64, use_native=hot_path == "native")
    try:
        data = {"image": images[0] if len(images) == 1 else images}
        out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY,
                           use_tqdm=False)
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("sizes", [[(60, 90)], [(60, 90), (112, 56)]])
def test_qwen2_vl_llm_generate_equals_transformers(qwen_dir, hot_path, sizes):
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    prompt = "Look: " + " and ".join([PAD] * len(images)) + " What is it?"
    expected = hf_generate(qwen_dir, hf_inputs(qwen_dir, prompt, images), MAX_TOKENS)
    assert len(set(expected)) > 1  # not a degenerate comparison
    assert llm_tokens(qwen_dir, prompt, images, hot_path) == expected


@pytest.mark.parametrize("num_images", [1, 2])
def test_llava_llm_generate_equals_transformers(llava_dir, hot_path, num_images):
    import transformers

    images = [random_image(40 + 8 * i, 60, seed=i) for i in range(num_images)]
    prompt = "hi " + " and ".join(["<image>"] * num_images) + " there"
    processor = transformers.AutoProcessor.from_pretrained(llava_dir)
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        llava_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert llm_tokens(llava_dir, prompt, images, hot_path) == expected


def test_serve_with_a_data_url_answers_like_llm_chat(qwen_dir, hot_path):
    """`enginecore serve` + the official client, base64 data URL: the same text as
    LLM.chat (whose tokens the tests above hold to transformers')."""
    import base64
    import io

    import openai

    from server_helpers import ServerProcess

    buf = io.BytesIO()
    random_image(60, 90, seed=3).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"}]}]
    llm = LLM(qwen_dir, dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              use_native=hot_path == "native")
    try:
        want = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    srv = ServerProcess([qwen_dir, "--served-model-name", "tiny-vl", "--max-model-len", "256",
                         "--dtype", "float32", "--kv-cache-memory-bytes", str(32 << 20)],
                        env={"ENGINECORE_NATIVE": "1" if hot_path == "native" else "0"})
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0,
                           timeout=60) as client:
            got = client.chat.completions.create(
                model="tiny-vl", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"ignore_eos": True})
    finally:
        srv.stop()
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens == MAX_TOKENS
