"""LLaVA (CLIP vision tower + projector + Llama) through the EngineCore on the
paged KV cache: greedy tokens with one and two images equal transformers'
generate on a tiny random model saved by transformers (native and Python paths)."""

from __future__ import annotations

import pytest
import torch

from enginecore import EngineArgs, EngineCore
from helpers import run_to_completion
from mm_requests import mm_request
from tiny_models import make_tiny_tokenizer

IMAGE_TOKEN = 329
PATCHES = 16  # (28 / 7) ** 2
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory) -> str:
    import transformers

    path = str(tmp_path_factory.mktemp("tiny-llava"))
    make_tiny_tokenizer(path)
    text = {"model_type": "llama", "vocab_size": 330, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256}
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 28,
              "patch_size": 7, "projection_dim": 32}
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def hf_generate(path: str, ids: list[int], pixel_values: torch.Tensor) -> list[int]:
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                             pixel_values=pixel_values, max_new_tokens=MAX_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("num_images", [1, 2])
@pytest.mark.parametrize("batched", [64, 7])
def test_greedy_matches_transformers(hot_path, tiny_llava, num_images, batched):
    torch.manual_seed(num_images)
    pixels = torch.randn(num_images, 3, 28, 28)
    ids = [1, 40, 41]
    for _ in range(num_images):
        ids += [IMAGE_TOKEN] * PATCHES + [50, 51]
    ref = hf_generate(tiny_llava, ids, pixels)
    eng = EngineCore(EngineArgs(model=tiny_llava, dtype="float32", block_size=8,
                                max_model_len=128, max_num_batched_tokens=batched,
                                max_num_encoder_input_tokens=64, encoder_cache_size=64,
                                num_gpu_blocks_override=32).create_engine_config())
    items = [{"pixel_values": pixels[i:i + 1]} for i in range(num_images)]
    eng.add_request(mm_request("r", ids, items, IMAGE_TOKEN, MAX_TOKENS))
    assert len(set(ref)) > 1  # not a degenerate comparison
    assert run_to_completion(eng)["r"]["tokens"] == ref
    assert eng.model_executor.runner.mm.num_encoded == num_images


def test_the_image_changes_the_tokens(tiny_llava):
    ids = [1, 40, 41] + [IMAGE_TOKEN] * PATCHES + [50, 51]
    torch.manual_seed(1)
    a, b = torch.randn(1, 3, 28, 28), torch.randn(1, 3, 28, 28)
    assert hf_generate(tiny_llava, ids, a) != hf_generate(tiny_llava, ids, b)


def test_unsupported_multimodal_architecture_names_the_supported():
    from enginecore.model.arch_config import arch_config_from_hf

    with pytest.raises(ValueError, match="LlavaForConditionalGeneration.*Qwen2VL"):
        arch_config_from_hf({"architectures": ["Idefics3ForConditionalGeneration"],
                             "vision_config": {}})
