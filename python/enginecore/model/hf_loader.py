"""Load an HF-format model directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)


INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The shards the index names (transformers' rule), else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [n for n, f in zip(names, files) if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        other = [os.path.basename(f) for f in glob.glob(os.path.join(model_dir, "*.bin"))]
        hint = f" (found {other}: PyTorch .bin weights are not supported)" if other else ""
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every shard, one at a time (memory-mapped)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
