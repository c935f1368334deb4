"""Qwen2-VL's vision encoder, images/s: enginecore's (model/qwen2_vl_vision.py)
next to transformers' ``Qwen2VisionTransformerPretrainedModel`` on the same
random weights, in one run.

Run: PYTHONPATH=python python bench/bench_qwen2_vl_encoder.py
(a reduced encoder: depth 4, embed 320, 8 heads, merger to 512; 224 x 224
images = 16 x 16 patches = 64 output tokens each; 8 images per call.)
``BENCH_VISION_IMAGES`` / ``BENCH_VISION_REPEATS`` / ``BENCH_VISION_SIDE`` change it.
"""

from __future__ import annotations

import os
import time

import torch

from enginecore.model.qwen2_vl_vision import Qwen2VisionConfig, Qwen2VisionEncoder

IMAGES = int(os.environ.get("BENCH_VISION_IMAGES", "8"))
REPEATS = int(os.environ.get("BENCH_VISION_REPEATS", "5"))
SIDE = int(os.environ.get("BENCH_VISION_SIDE", "224"))
VISION = dict(depth=4, embed_dim=320, hidden_size=512, num_heads=8, mlp_ratio=4,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


def reference_encoder():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(vision_config=VISION).vision_config
    cfg._attn_implementation = "sdpa"
    return Qwen2VisionTransformerPretrainedModel(cfg).eval()


def ours_from(ref, dtype: torch.dtype) -> Qwen2VisionEncoder:
    enc = Qwen2VisionEncoder(Qwen2VisionConfig.from_hf(VISION), dtype, torch.device("cpu"))
    enc.load_weights(ref.state_dict().items())
    return enc


def images_per_s(fn, pixels, grid) -> float:
    fn(pixels, grid)  # warm-up
    t0 = time.perf_counter()
    for _ in range(REPEATS):
        fn(pixels, grid)
    return REPEATS * IMAGES / (time.perf_counter() - t0)


def main() -> None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # oneDNN's bf16 packing needs it
        os.environ["ENGINECORE_PACK_WEIGHTS"] = "0"
    ref = reference_encoder()
    g = SIDE // 14
    grid = torch.tensor([[1, g, g]] * IMAGES)
    pixels = torch.randn(IMAGES * g * g, 3 * 2 * 14 * 14)
    rows = []
    with torch.inference_mode():
        rows.append(("transformers float32", images_per_s(
            lambda p, gr: ref(p, grid_thw=gr), pixels, grid)))
        for dtype in (torch.float32, torch.bfloat16):
            enc = ours_from(ref, dtype)
            grids = grid.tolist()
            rows.append((f"enginecore {str(dtype)[6:]}", images_per_s(
                lambda p, _, enc=enc, grids=grids: enc.forward(p, grids), pixels, grid)))
        ref_bf16 = ref.to(torch.bfloat16)
        rows.append(("transformers bfloat16", images_per_s(
            lambda p, gr: ref_bf16(p.bfloat16(), grid_thw=gr), pixels, grid)))
    print(f"{IMAGES} images of {SIDE}x{SIDE} per call, {REPEATS} calls, "
          f"{torch.get_num_threads()} threads")
    for name, v in rows:
        print(f"{name:24s} {v:8.1f} images/s")


if __name__ == "__main__":
    main()
