"""Qwen2-VL's language model on the paged KV cache with M-RoPE, driven by hand
(prefill chunks, then decode at position + rope delta), against transformers'
forward and generate on a tiny random model, on the native and the Python path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore.model.arch_config import load_arch_config
from enginecore.model.attention import make_attention_metadata
from enginecore.model.hf_loader import iterate_weights
from enginecore.model.qwen2_vl import Qwen2VLForConditionalGeneration
from tiny_qwen2_vl import hf_generate, hf_inputs, hf_model, make_tiny_qwen2_vl, random_image

BLOCK = 8
CPU = torch.device("cpu")
PROMPT_ONE = "<s>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?</s>\n<s>assistant\n"
PROMPT_TWO = ("<s>user\nCompare <|vision_start|><|image_pad|><|vision_end|> and "
              "<|vision_start|><|image_pad|><|vision_end|></s>\n<s>assistant\n")


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl")))


def load(model_dir: str, dtype=torch.float32) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration.from_model_dir(load_arch_config(model_dir), model_dir,
                                                           dtype, CPU)
    model.load_weights(iterate_weights(model_dir))
    return model


class PagedRun:
    """One sequence on a paged cache whose blocks are handed out in reverse order
    (so a wrong slot mapping cannot pass by accident)."""

    def __init__(self, model, max_len: int = 128) -> None:
        cfg = model.cfg
        self.model = model
        nb = max_len // BLOCK
        self.blocks = list(range(nb))[::-1]
        self.scratch = nb * BLOCK
        shape = ((nb + 1) * BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                   for _ in range(cfg.num_layers)]
        self.done = 0

    def step(self, ids: list[int], positions: np.ndarray, embeds: torch.Tensor | None = None):
        n = len(ids)
        pos = np.arange(self.done, self.done + n)
        slots = np.asarray(self.blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        end = self.done + n
        table = np.asarray([self.blocks[: -(-end // BLOCK)]], dtype=np.int32)
        meta = make_attention_metadata(slots, np.array([0, n]), np.array([end]), table, BLOCK,
                                       self.scratch, CPU)
        hidden = self.model.forward(torch.tensor(ids), torch.from_numpy(np.ascontiguousarray(
            positions)), meta, self.kv, inputs_embeds=embeds)
        self.done = end
        return self.model.compute_logits(hidden)


def prompt_parts(model, inputs):
    ids = inputs["input_ids"][0]
    mask = ids == model.mm.image_token_id
    grids = inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else []
    embeds = model.embed_multimodal(inputs["pixel_values"], grids) if grids else []
    flags = mask.tolist()
    starts = [i for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1])]
    return ids, mask, torch.cat(embeds) if embeds else None, list(zip(starts, grids))


def run_greedy(model, inputs, max_tokens: int, chunk: int | None = None) -> list[int]:
    ids, mask, mm_embeds, placeholders = prompt_parts(model, inputs)
    L = len(ids)
    pos, delta = model.get_mrope_input_positions(L, placeholders)
    embeds = model.embed_input_ids(ids, mm_embeds, mask if mm_embeds is not None else None)
    run = PagedRun(model)
    chunk = chunk or L
    for s in range(0, L, chunk):
        logits = run.step(ids[s:s + chunk].tolist(), pos[:, s:s + chunk], embeds[s:s + chunk])
    out = [int(logits[-1].argmax())]
    while len(out) < max_tokens:
        p = L + len(out) - 1
        logits = run.step([out[-1]], model.positions_past_prompt(p, p + 1, delta))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.parametrize("chunk", [None, 5])
def test_prefill_logits_match_transformers(hot_path, tiny_qwen2_vl, chunk):
    model = load(tiny_qwen2_vl)
    inputs = hf_inputs(tiny_qwen2_vl, PROMPT_TWO, [random_image(60, 90, 1),
                                                   random_image(112, 56, 2)])
    with torch.no_grad():
        ref = hf_model(tiny_qwen2_vl)(**inputs).logits[0]
    ids, mask, mm_embeds, placeholders = prompt_parts(model, inputs)
    pos, _ = model.get_mrope_input_positions(len(ids), placeholders)
    embeds = model.embed_input_ids(ids, mm_embeds, mask)
    run = PagedRun(model)
    chunk = chunk or len(ids)
    logits = torch.cat([run.step(ids[s:s + chunk].tolist(), pos[:, s:s + chunk],
                                 embeds[s:s + chunk]) for s in range(0, len(ids), chunk)])
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt,sizes", [(PROMPT_ONE, [(60, 90)]),
                                          (PROMPT_TWO, [(60, 90), (112, 56)])])
def test_greedy_matches_transformers_generate(hot_path, tiny_qwen2_vl, prompt, sizes):
    model = load(tiny_qwen2_vl)
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    inputs = hf_inputs(tiny_qwen2_vl, prompt, images)
    ref = hf_generate(tiny_qwen2_vl, inputs, 12)
    assert run_greedy(model, inputs, 12) == ref
    assert run_greedy(model, inputs, 12, chunk=7) == ref


def test_images_change_the_tokens(tiny_qwen2_vl):
    """Not a vacuous comparison: another image (and M-RoPE vs plain positions)
    gives other logits."""
    model = load(tiny_qwen2_vl)
    a = hf_inputs(tiny_qwen2_vl, PROMPT_ONE, [random_image(60, 90, 0)])
    b = hf_inputs(tiny_qwen2_vl, PROMPT_ONE, [random_image(60, 90, 5)])
    ids, mask, ea, ph = prompt_parts(model, a)
    _, _, eb, _ = prompt_parts(model, b)
    pos, _ = model.get_mrope_input_positions(len(ids), ph)
    la = PagedRun(model).step(ids.tolist(), pos, model.embed_input_ids(ids, ea, mask))
    lb = PagedRun(model).step(ids.tolist(), pos, model.embed_input_ids(ids, eb, mask))
    flat = np.broadcast_to(np.arange(len(ids)), (3, len(ids)))
    lc = PagedRun(model).step(ids.tolist(), flat, model.embed_input_ids(ids, ea, mask))
    assert (la[-1] - lb[-1]).abs().max() > 1e-2
    assert (la[-1] - lc[-1]).abs().max() > 1e-2


def test_text_only_prompt_matches_transformers(hot_path, tiny_qwen2_vl):
    model = load(tiny_qwen2_vl)
    inputs = hf_inputs(tiny_qwen2_vl, "<s>user\nThe capital of France</s>\n<s>assistant\n", [])
    ref = hf_generate(tiny_qwen2_vl, inputs, 8)
    assert run_greedy(model, inputs, 8) == ref


def test_placeholder_count_mismatch_is_an_error(tiny_qwen2_vl):
    model = load(tiny_qwen2_vl)
    inputs = hf_inputs(tiny_qwen2_vl, PROMPT_ONE, [random_image(60, 90, 0)])
    ids, mask, embeds, _ = prompt_parts(model, inputs)
    with pytest.raises(ValueError, match="placeholder tokens but"):
        model.embed_input_ids(ids, embeds[:-1], mask)
