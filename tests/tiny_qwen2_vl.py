"""A tiny random Qwen2-VL saved by transformers, with its image processor (the
PIL one: torchvision is not installed) and a byte-level tokenizer that has the
vision special tokens; plus transformers-side helpers that make the reference
inputs the way Qwen2VLProcessor does (which itself needs torchvision here)."""

from __future__ import annotations

import os

import numpy as np
import torch

from tiny_models import make_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat template for content parts (an image is its three vision tokens).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def tiny_qwen2_vl_config(vocab_size: int = 324, **text_overrides):
    import transformers

    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                # head_dim 16: 8 frequencies, 2 temporal, 3 height, 3 width
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0})
    text.update(text_overrides)
    vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=4,
                  mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    base = vocab_size - len(VISION_TOKENS)
    return transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=base,
        vision_end_token_id=base + 1, image_token_id=base + 2, video_token_id=base + 3,
        tie_word_embeddings=False)


def make_tiny_qwen2_vl(path: str, seed: int = 0) -> str:
    """Model (weights larger than the init, so images and positions change tokens),
    tokenizer (ids 320-323 the vision tokens), image processor, chat template."""
    import transformers

    os.makedirs(path, exist_ok=True)
    make_tiny_tokenizer(path)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tok.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(path)
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(tiny_qwen2_vl_config(len(tok)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif "bias" in name:  # q/k/v biases (and the vision ones) matter
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def hf_inputs(model_dir: str, text: str, images: list) -> dict[str, torch.Tensor]:
    """What Qwen2VLProcessor returns: each <|image_pad|> expanded to its image's
    token count, pixel_values, image_grid_thw, mm_token_type_ids."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ip = transformers.AutoImageProcessor.from_pretrained(model_dir)
    feats = ip(images=images, return_tensors="pt") if images else {}
    grids = feats["image_grid_thw"].tolist() if images else []
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(grids) + 1, "one <|image_pad|> per image"
    expanded = pieces[0]
    for g, rest in zip(grids, pieces[1:]):
        expanded += "<|image_pad|>" * (g[0] * g[1] * g[2] // ip.merge_size**2) + rest
    ids = torch.tensor([tok(expanded, add_special_tokens=False)["input_ids"]])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "mm_token_type_ids": (ids == image_id).int()}
    if images:
        out["pixel_values"] = feats["pixel_values"]
        out["image_grid_thw"] = feats["image_grid_thw"]
    return out


_models: dict[str, object] = {}


def hf_model(model_dir: str):
    import transformers

    key = os.path.abspath(model_dir)
    if key not in _models:
        _models[key] = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    return _models[key]


def hf_generate(model_dir: str, inputs: dict[str, torch.Tensor], max_tokens: int) -> list[int]:
    """transformers' greedy generate (its KV cache and rope deltas)."""
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
