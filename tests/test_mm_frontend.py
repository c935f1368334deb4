"""The multimodal front-end: the model's own HF image processor and placeholder
expansion (against transformers' outputs), chat image parts, bad images as
ValueErrors naming the problem, and the sender / receiver cache pair."""

import base64
import io
import random
import struct
import zlib

import pytest
import torch

from enginecore.config import EngineArgs
from enginecore.frontend.async_llm import load_tokenizer
from enginecore.frontend.input_processor import InputProcessor
from enginecore.multimodal import (
    MultiModalFeatureSpec,
    PlaceholderRange,
    tensor_from_wire,
    tensor_to_wire,
)
from enginecore.multimodal.cache import MultiModalReceiverCache, MultiModalSenderCache
from tiny_qwen2_vl import hf_inputs, make_tiny_qwen2_vl, random_image

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen2vl")))


def processor(model_dir, **kwargs):
    cfg = EngineArgs(model=model_dir, **kwargs).create_engine_config()
    return InputProcessor(cfg, load_tokenizer(cfg))


def png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(png_bytes(image)).decode()


def huge_png(width=30000, height=30000):
    """A valid PNG header for a 30,000 x 30,000 image: a few bytes that would decode
    to 2.7 GB."""
    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("sizes", [[(56, 84)], [(56, 56), (84, 112)]])
def test_processing_equals_the_hf_processor(qwen_dir, sizes):
    ip = processor(qwen_dir)
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    text = "look " + " and ".join([PAD] * len(images)) + " now"
    _, req = ip.process_inputs("r", {"prompt": text, "multi_modal_data": {"image": images}}, None)
    ref = hf_inputs(qwen_dir, text, images)
    assert req.prompt_token_ids == ref["input_ids"][0].tolist()
    pixels = torch.cat([tensor_from_wire(f.data["pixel_values"]) for f in req.mm_features])
    grids = torch.cat([tensor_from_wire(f.data["image_grid_thw"]) for f in req.mm_features])
    assert torch.equal(pixels, ref["pixel_values"]) and torch.equal(grids, ref["image_grid_thw"])
    image_id = ip.mm_processor.image_token_id
    for f in req.mm_features:
        start = f.mm_position.offset
        span = req.prompt_token_ids[start:start + f.mm_position.length]
        assert span == [image_id] * f.mm_position.length
    # Same pixels: same identifier; other pixels of the same size: another one.
    _, again = ip.process_inputs("s", {"prompt": text, "multi_modal_data": {"image": images}}, None)
    assert [f.identifier for f in again.mm_features] == [f.identifier for f in req.mm_features]
    other = random_image(*sizes[0], seed=99)
    _, diff = ip.process_inputs("t", {"prompt": "look " + PAD + " now",
                                      "multi_modal_data": {"image": other}}, None)
    assert diff.mm_features[0].identifier != req.mm_features[0].identifier


def test_chat_image_url_parts_equal_the_hf_processor(qwen_dir):
    ip = processor(qwen_dir)
    image = random_image(56, 84, seed=3)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "what is this?"}]}]
    prompt = ip.render_chat(messages)
    _, req = ip.process_inputs("r", prompt, None)
    text = ("<s>user\n" + PAD + "what is this?</s>\n<s>assistant\n")
    decoded = image.copy()  # the PNG round trip is lossless
    assert req.prompt_token_ids == hf_inputs(qwen_dir, text, [decoded])["input_ids"][0].tolist()


def bad_prompt(image_part):
    return [{"role": "user", "content": [image_part, {"type": "text", "text": "hi"}]}]


def test_bad_images_are_value_errors_naming_the_problem(qwen_dir, tiny_chat_model):
    ip = processor(qwen_dir, limit_mm_per_prompt={"image": 1})
    image = random_image(56, 56)
    cases = {
        "cannot decode": {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()}},
        "too large|over the limit": {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(huge_png()).decode()}},
        "unsupported image MIME type": {"type": "image_url", "image_url": {
            "url": "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()}},
        "not allowed": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    }
    for match, part in cases.items():
        with pytest.raises(ValueError, match=match):
            ip.process_inputs("r", ip.render_chat(bad_prompt(part)), None)
    with pytest.raises(ValueError, match="At most 1 image"):
        ip.process_inputs("r", {"prompt": PAD + PAD, "multi_modal_data": {"image": [image, image]}},
                          None)
    with pytest.raises(ValueError, match="placeholder"):
        ip.process_inputs("r", {"prompt": "no placeholder", "multi_modal_data": {"image": image}},
                          None)
    with pytest.raises(ValueError, match="does not take images"):
        processor(tiny_chat_model).process_inputs(
            "r", {"prompt": "hi", "multi_modal_data": {"image": image}}, None)
    with pytest.raises(ValueError, match="does not take images"):
        processor(tiny_chat_model).render_chat(bad_prompt(
            {"type": "image_url", "image_url": {"url": data_url(image)}}))
    # The processor still serves after each refusal.
    _, ok = ip.process_inputs("r", {"prompt": PAD, "multi_modal_data": {"image": image}}, None)
    assert len(ok.mm_features) == 1


def feature(identifier, nbytes, offset=0):
    data = {"pixel_values": tensor_to_wire(
        torch.full((nbytes,), hash(identifier) % 200, dtype=torch.uint8))}
    return MultiModalFeatureSpec("image", identifier, PlaceholderRange(offset, 1), data)


def test_sender_and_receiver_caches_agree_under_eviction():
    rng = random.Random(0)
    sizes = {f"img{i}": rng.randint(1, 400) for i in range(40)}
    sender, receiver = MultiModalSenderCache(1000), MultiModalReceiverCache(1000)
    sizes["huge"] = 2000  # larger than the caches: always sent, never kept
    stripped = 0
    for _ in range(500):
        ids = rng.sample(sorted(sizes), rng.randint(1, 3))
        full = [feature(i, sizes[i], offset=n) for n, i in enumerate(ids)]
        sent = sender.strip_cached(full)
        stripped += sum(f.data is None for f in sent)
        got = receiver.get_and_update_features(sent)  # never misses
        assert [f.data for f in got] == [f.data for f in full]
        assert sender.keys() == receiver.keys() and sender.size_bytes == receiver.size_bytes <= 1000
    assert stripped > 50 and "huge" not in sender
    queries, hits = receiver.take_stats()
    assert hits == stripped and queries > hits
    sender.clear()
    receiver.clear()
    with pytest.raises(ValueError, match="does not hold it"):
        receiver.get_and_update_features(
            [MultiModalFeatureSpec("image", "img0", PlaceholderRange(0, 1))])


def test_the_same_image_in_8_concurrent_requests_crosses_the_wire_once(qwen_dir, hot_path):
    from enginecore import LLM, SamplingParams

    llm = LLM(qwen_dir, max_model_len=256, num_gpu_blocks_override=64, disable_log_stats=False,
              use_native=hot_path == "native")
    try:
        sent = []
        add = llm.client.add_request

        def record(request):
            sent.append(request)
            add(request)

        llm.client.add_request = record
        lookups = [0, 0]  # the engine's receiver cache: items that arrived, items it held
        record_stats = llm.metrics.record

        def count(iteration, stats=None, *args):
            if stats is not None and stats.mm_cache_stats is not None:
                lookups[0] += stats.mm_cache_stats.queries
                lookups[1] += stats.mm_cache_stats.hits
            return record_stats(iteration, stats, *args)

        llm.metrics.record = count
        image = random_image(56, 84, seed=5)
        prompt = {"prompt": "see " + PAD + " here", "multi_modal_data": {"image": image}}
        outs = llm.generate([prompt] * 8, SamplingParams(max_tokens=2, temperature=0.0),
                            use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)  # every id resolved
        carried = [f.data is not None for r in sent for f in r.mm_features]
        assert carried == [True] + [False] * 7
        assert lookups == [8, 7]
        assert llm.reset_mm_cache() is True
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
        assert sent[-1].mm_features[0].data is not None  # both sides forgot it
    finally:
        llm.shutdown()


def test_http_images_only_from_allowed_hosts_within_the_limits():
    import http.server
    import threading

    from enginecore.config_cli import add_dataclass_args
    from enginecore.multimodal.media import MediaLimits, image_from_url

    body = png_bytes(random_image(28, 28))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain" if "txt" in self.path else "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/a.png"
    try:
        with pytest.raises(ValueError, match="not allowed"):
            image_from_url(url, MediaLimits())
        allowed = MediaLimits(allowed_domains=("127.0.0.1",))
        assert image_from_url(url, allowed).size == (28, 28)
        with pytest.raises(ValueError, match="over the limit"):
            image_from_url(url, MediaLimits(max_bytes=100, allowed_domains=("127.0.0.1",)))
        with pytest.raises(ValueError, match="MIME"):
            image_from_url(url + "?txt", allowed)
    finally:
        httpd.shutdown()
        httpd.server_close()
    import argparse

    args = add_dataclass_args(argparse.ArgumentParser(), EngineArgs).parse_args(
        ["--allowed-media-domains", "a.example", "b.example", "--limit-mm-per-prompt",
         '{"image": 2}'])
    assert args.allowed_media_domains == ["a.example", "b.example"]
    assert args.limit_mm_per_prompt == {"image": 2}


def make_tiny_llava(path):
    """A tiny random LLaVA (CLIP tower + llama) saved by transformers with its
    LlavaProcessor (CLIP's PIL image processor, 28 px, 14 px patches)."""
    import transformers

    from tiny_models import make_tiny_tokenizer

    make_tiny_tokenizer(path)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>")
    processor.save_pretrained(path)
    cfg = transformers.LlavaConfig(
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 28, "patch_size": 14},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2},
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default")
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(path)
    return processor


@pytest.mark.parametrize("num_images", [1, 2])
def test_llava_processing_equals_llava_processor(tmp_path, num_images):
    import json

    from enginecore.multimodal.media import MediaLimits
    from enginecore.multimodal.processing import MultiModalProcessor

    hf = make_tiny_llava(str(tmp_path))
    images = [random_image(40 + 8 * i, 60, seed=i) for i in range(num_images)]
    text = "hi " + " and ".join(["<image>"] * num_images) + " there"
    ref = hf(text=text, images=images, return_tensors="pt")
    with open(tmp_path / "config.json") as f:
        mp = MultiModalProcessor(str(tmp_path), json.load(f), MediaLimits(), {})
    ids = hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    expanded, features = mp.process(ids, {"image": images})
    assert expanded == ref["input_ids"][0].tolist()
    pixels = torch.cat([tensor_from_wire(f.data["pixel_values"]) for f in features])
    assert torch.equal(pixels, ref["pixel_values"])
    assert all(f.mm_position.length == 4 for f in features)  # (28/14)^2, CLS dropped


def test_prefix_cache_hits_for_the_same_image_never_for_another(qwen_dir, hot_path):
    from enginecore import LLM, SamplingParams

    llm = LLM(qwen_dir, max_model_len=256, num_gpu_blocks_override=64, block_size=4,
              multiprocess_mode=False, use_native=hot_path == "native")
    try:
        def cached(seed):
            prompt = {"prompt": "see " + PAD + " here and there",
                      "multi_modal_data": {"image": random_image(56, 84, seed=seed)}}
            out = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
            return out.num_cached_tokens, len(out.prompt_token_ids)

        assert cached(1)[0] == 0
        hits, n = cached(1)
        assert hits == 4 * ((n - 1) // 4)  # the same image: every full block but the last token's
        hits_other, _ = cached(2)  # same size, other pixels: only the text before it
        assert hits_other == 4  # block 0 is text; block 1 holds the image's first tokens
    finally:
        llm.shutdown()
