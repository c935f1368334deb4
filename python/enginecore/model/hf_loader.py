"""Load an HF-format model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, one at a time (memory-mapped)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
