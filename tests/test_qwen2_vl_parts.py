"""Qwen2-VL's pieces against transformers on a tiny random model: the vision
encoder, M-RoPE positions (get_rope_index and the decode rope deltas) and the
M-RoPE rotation (native and twin)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from enginecore.model.arch_config import LlamaArchConfig
from enginecore.model.hf_loader import iterate_weights
from enginecore.model.mrope import (
    MRotaryStep,
    mrope_column_rows,
    mrope_input_positions,
    positions_with_delta,
)
from enginecore.model.qwen2_vl_vision import Qwen2VisionConfig, Qwen2VisionEncoder
from enginecore.model.rope import rope_cos_sin
from tiny_qwen2_vl import hf_inputs, hf_model, make_tiny_qwen2_vl, random_image


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny-qwen2-vl")))


def load_encoder(model_dir: str, dtype=torch.float32) -> Qwen2VisionEncoder:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Qwen2VisionConfig.from_hf(json.load(f)["vision_config"])
    enc = Qwen2VisionEncoder(cfg, dtype, torch.device("cpu"))
    enc.load_weights((n[len("visual."):], t) for n, t in iterate_weights(model_dir)
                     if n.startswith("visual."))
    return enc


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 4, 6), (2, 2, 4), (1, 6, 2)]])
def test_vision_encoder_matches_transformers(tiny_qwen2_vl, grids):
    enc = load_encoder(tiny_qwen2_vl)
    grid = torch.tensor(grids)
    torch.manual_seed(1)
    pixels = torch.randn(int(grid.prod(-1).sum()), enc.cfg.patch_dim)
    with torch.no_grad():
        ref = hf_model(tiny_qwen2_vl).model.get_image_features(pixels, grid).pooler_output
    ours = enc.forward(pixels, grids)
    assert [tuple(o.shape) for o in ours] == [tuple(r.shape) for r in ref]
    for r, o in zip(ref, ours):
        assert torch.equal(r, o)


def test_vision_encoder_on_processor_output(tiny_qwen2_vl):
    """Real processor output (PIL resize to multiples of 28, patch flattening)."""
    enc = load_encoder(tiny_qwen2_vl)
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    inputs = hf_inputs(tiny_qwen2_vl, text, [random_image(60, 90, seed=3)])
    with torch.no_grad():
        ref = hf_model(tiny_qwen2_vl).model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
    ours, = enc.forward(inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    assert torch.equal(ours, ref)


def test_vision_encoder_bfloat16_close(tiny_qwen2_vl, monkeypatch):
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # oneDNN's bf16 packing needs it
        monkeypatch.setenv("ENGINECORE_PACK_WEIGHTS", "0")
    enc = load_encoder(tiny_qwen2_vl, torch.bfloat16)
    grids = [(1, 4, 4)]
    pixels = torch.randn(16, enc.cfg.patch_dim)
    ref = load_encoder(tiny_qwen2_vl).forward(pixels, grids)[0]
    out = enc.forward(pixels, grids)[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def test_vision_encoder_rejects_mismatched_pixels(tiny_qwen2_vl):
    enc = load_encoder(tiny_qwen2_vl)
    with pytest.raises(ValueError, match="do not match the grids"):
        enc.forward(torch.randn(20, enc.cfg.patch_dim), [(1, 4, 4)])
    with pytest.raises(ValueError, match="spatial merge size"):
        enc.forward(torch.randn(15, enc.cfg.patch_dim), [(1, 3, 5)])


def _placeholders(input_ids: torch.Tensor, types: torch.Tensor, grids) -> list:
    """(offset, grid) of each run of placeholder tokens."""
    t = types[0].tolist()
    starts = [i for i, v in enumerate(t) if v and (i == 0 or not t[i - 1])]
    return list(zip(starts, grids))


@pytest.mark.parametrize("layout", [
    ("img", "text"), ("text", "img", "text"), ("text", "img", "img", "text"),
    ("text", "img", "text", "vid", "text", "img"), ("text",)])
def test_mrope_positions_match_get_rope_index(tiny_qwen2_vl, layout):
    model = hf_model(tiny_qwen2_vl).model
    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size
    rng = np.random.RandomState(len(layout))
    ids, types, image_grids, video_grids, order = [], [], [], [], []
    grid_choices = [(1, 4, 6), (1, 8, 2), (1, 2, 2), (3, 4, 4)]
    for part in layout:
        if part == "text":
            n = int(rng.randint(1, 7))
            ids += rng.randint(3, 300, n).tolist()
            types += [0] * n
            continue
        grid = (3, 4, 2) if part == "vid" else grid_choices[len(order) % 3]
        n = grid[0] * grid[1] * grid[2] // merge**2
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        kind = 2 if part == "vid" else 1
        types += [0] + [kind] * n + [0]
        (video_grids if part == "vid" else image_grids).append(grid)
        order.append(grid)
    input_ids = torch.tensor([ids])
    type_ids = torch.tensor([types])
    has_mm = bool(order)
    if has_mm:
        ref, ref_delta = model.get_rope_index(
            input_ids, type_ids, torch.tensor(image_grids) if image_grids else None,
            torch.tensor(video_grids) if video_grids else None)
        ref, ref_delta = ref[:, 0].numpy(), int(ref_delta[0, 0])
    else:
        ref, ref_delta = np.broadcast_to(np.arange(len(ids)), (3, len(ids))), 0
    pos, delta = mrope_input_positions(len(ids), _placeholders(input_ids, type_ids, order), merge)
    np.testing.assert_array_equal(pos, ref)
    assert delta == ref_delta
    # decode: transformers' positions for tokens past the prompt are cache length + delta
    L = len(ids)
    np.testing.assert_array_equal(positions_with_delta(L, L + 3, delta),
                                  np.broadcast_to(np.arange(L, L + 3) + ref_delta, (3, 3)))


def test_mrope_positions_reject_bad_placeholders():
    with pytest.raises(ValueError, match="runs past"):
        mrope_input_positions(5, [(2, (1, 4, 4))], 2)
    with pytest.raises(ValueError, match="overlaps"):
        mrope_input_positions(20, [(2, (1, 4, 4)), (4, (1, 2, 2))], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mrope_rotation_matches_transformers(hot_path, tiny_qwen2_vl, dtype):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

    text_model = hf_model(tiny_qwen2_vl).model.language_model
    tc = text_model.config
    D = tc.hidden_size // tc.num_attention_heads
    arch = LlamaArchConfig("Qwen2VLForConditionalGeneration", tc.hidden_size,
                           tc.intermediate_size, tc.num_hidden_layers, tc.num_attention_heads,
                           tc.num_key_value_heads, D, tc.vocab_size,
                           rope_theta=tc.rope_parameters["rope_theta"])
    cos_t, sin_t = (t.to(dtype) for t in rope_cos_sin(arch, 512))
    pos, _ = mrope_input_positions(14, [(2, (1, 4, 6)), (9, (1, 2, 4))], 2)
    positions = torch.from_numpy(pos)
    torch.manual_seed(0)
    q = torch.randn(14, 4, D).to(dtype)
    k = torch.randn(14, 2, D).to(dtype)
    cos, sin = text_model.rotary_emb(q, positions[:, None, :])  # [3, 1, T, D] -> [1, T, D]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos.to(dtype), sin.to(dtype))
    qk = torch.cat([q, k], dim=1)
    rows = mrope_column_rows(tc.rope_parameters["mrope_section"], D)
    out = MRotaryStep(cos_t, sin_t, positions, rows)(qk)
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[:, :4], ref_q[0].transpose(0, 1), **tol)
    torch.testing.assert_close(out[:, 4:], ref_k[0].transpose(0, 1), **tol)


def test_mrope_rotation_native_equals_twin(tiny_qwen2_vl):
    from enginecore import _native

    D = 16
    arch = LlamaArchConfig("Qwen2VLForConditionalGeneration", 64, 128, 2, 4, 2, D, 324)
    rows = mrope_column_rows([2, 3, 3], D)
    pos = torch.from_numpy(mrope_input_positions(30, [(3, (1, 8, 6))], 2)[0])
    for dtype in (torch.float32, torch.bfloat16):
        cos_t, sin_t = (t.to(dtype) for t in rope_cos_sin(arch, 64))
        x = torch.randn(30, 6, D).to(dtype)
        outs = []
        for native in (True, False):
            prev = _native._enabled
            _native.set_native(native)
            try:
                outs.append(MRotaryStep(cos_t, sin_t, pos, rows)(x.clone()))
            finally:
                _native._enabled = prev
        assert torch.equal(outs[0], outs[1])


def test_mrope_section_must_cover_the_rotary():
    with pytest.raises(ValueError, match="half the rotary"):
        mrope_column_rows([2, 3, 2], 16)


def test_mrope_chunk_positions_across_the_prompt_end():
    from enginecore.model.mrope import mrope_chunk_positions

    pos, delta = mrope_input_positions(12, [(1, (1, 4, 8))], 2)
    assert delta < 0
    full = np.concatenate([pos, positions_with_delta(12, 20, delta)], axis=1)
    for start, end in [(0, 5), (3, 12), (10, 15), (12, 13), (15, 20)]:
        np.testing.assert_array_equal(mrope_chunk_positions(pos, delta, start, end),
                                      full[:, start:end])


def test_split_image_items_follow_the_grids(tiny_qwen2_vl):
    from enginecore.model.qwen2_vl import split_image_items

    imgs = [random_image(60, 90, 1), random_image(112, 56, 2)]
    text = "<|image_pad|> and <|image_pad|>"
    inputs = hf_inputs(tiny_qwen2_vl, text, imgs)
    items = split_image_items(inputs["pixel_values"], inputs["image_grid_thw"])
    assert [it["image_grid_thw"].tolist() for it in items] == [[g] for g in
                                                               inputs["image_grid_thw"].tolist()]
    enc = load_encoder(tiny_qwen2_vl)
    whole = enc.forward(inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    for it, ref in zip(items, whole):  # alone vs batched: the GEMMs' row count changes ulps
        out = enc.forward(it["pixel_values"], it["image_grid_thw"].tolist())[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="patches"):
        split_image_items(inputs["pixel_values"][:-1], inputs["image_grid_thw"])
