"""``save_sharded_state``: the running weights as an HF checkpoint that both
enginecore and transformers load.

Layout (what transformers' ``save_pretrained`` writes): tensors under the
checkpoint's HF names (unfused), ``model.safetensors`` when one shard holds
everything, else ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``weight_map``: tensor -> file); the
source's config.json (``tie_word_embeddings`` and the dtype set to what was
saved) and tokenizer files beside them.

Everything is written inside the directory given: a shard name (from
``pattern``) that is absolute, contains a path separator or ``..``, or does not
end in ``.safetensors`` is refused, as is a target that is a symbolic link or a
directory that already holds other ``*.safetensors`` (they would be loaded as
weights too) -- all checked before the first byte is written. Each file is
written beside its target and renamed into place.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import torch

from enginecore.model.hf_loader import INDEX_FILE

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 << 30
# Copied from the source directory when present.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "chat_template.jinja", "tokenizer.model")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def save_checkpoint(model, source_dir: str, path: str, pattern: str | None = None,
                    max_size: int | None = None, rank: int = 0) -> list[str]:
    """Write ``model.state_dict_hf()`` into ``path``; returns the shard file names.

    ``pattern`` names shard i: ``str.format`` with i positionally and as
    ``part``, and the DP ``rank`` (vLLM's 'model-rank-{rank}-part-{part}.safetensors'
    works, as does 'model-{:05d}.safetensors')."""
    if not path:
        raise ValueError("save_sharded_state needs a directory")
    max_size = DEFAULT_MAX_SHARD_BYTES if max_size is None else int(max_size)
    if max_size <= 0:
        raise ValueError(f"max_size must be > 0, got {max_size}")
    state = model.state_dict_hf()
    shards = _plan_shards(state, max_size)
    names = _shard_names(len(shards), pattern, rank)
    _check_targets(path, names)

    os.makedirs(path, exist_ok=True)
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for name, keys in zip(names, shards):
        # Clones: the unfused q/k/v (and gate/up) are views of one fused tensor.
        tensors = {k: state[k].detach().to("cpu").clone() for k in keys}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        _write(os.path.join(path, name), lambda tmp, t=tensors: save_file(
            t, tmp, metadata={"format": "pt"}))
        weight_map |= dict.fromkeys(keys, name)
    index = os.path.join(path, INDEX_FILE)
    if len(names) > 1:
        body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write(index, lambda tmp: _dump_json(body, tmp))
    elif os.path.exists(index):  # one shard now: a stale index would point elsewhere
        os.remove(index)
    _write_config(model, source_dir, path)
    for fname in SIDE_FILES:
        src = os.path.join(source_dir, fname)
        if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
                os.path.join(path, fname)):
            _write(os.path.join(path, fname), lambda tmp, s=src: shutil.copyfile(s, tmp))
    logger.info("saved %d weight shard(s), %.1f MiB, to %s", len(names), total / 2**20, path)
    return names


def _plan_shards(state: dict[str, torch.Tensor], max_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _shard_names(n: int, pattern: str | None, rank: int) -> list[str]:
    if pattern is None:
        return ["model.safetensors"] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    try:
        names = [pattern.format(i, part=i, rank=rank) for i in range(n)]
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"bad shard pattern {pattern!r}: {e!r}; use e.g. "
                         "'model-{:05d}.safetensors' or 'model-rank-{rank}-part-{part}"
                         ".safetensors'") from None
    for name in names:
        if (os.path.isabs(name) or "/" in name or "\\" in name
                or not name.endswith(".safetensors")):
            raise ValueError(f"shard name {name!r} (from pattern {pattern!r}) must be a plain "
                             "file name ending in .safetensors, inside the directory given")
    if len(set(names)) < n:
        raise ValueError(f"pattern {pattern!r} gives the same name to several of the {n} "
                         "shards; put {} or {part} in it")
    return names


def _check_targets(path: str, names: list[str]) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory")
    targets = [*names, INDEX_FILE, "config.json", *SIDE_FILES]
    links = [t for t in targets if os.path.islink(os.path.join(path, t))]
    if links:
        raise ValueError(f"refusing to write through symbolic links in {path}: {links}")
    others = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors"))
                    if os.path.basename(f) not in names)
    if others:
        raise ValueError(f"{path} already holds other weights {others}; they would load with "
                         "the new ones: save into an empty directory")


def _write_config(model, source_dir: str, path: str) -> None:
    with open(os.path.join(source_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["tie_word_embeddings"] = model.lm_head is model.embed
    dtype = _DTYPE_NAMES.get(model.dtype, "float32")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
    for k in keys:
        cfg[k] = dtype
    _write(os.path.join(path, "config.json"), lambda tmp: _dump_json(cfg, tmp))


def _dump_json(obj, target: str) -> None:
    with open(target, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def _write(target: str, write) -> None:
    """write(tmp) beside the target, then rename it into place."""
    tmp = target + ".partial"
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
