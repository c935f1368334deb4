"""GGUF -> an HF-format directory (config.json, model.safetensors, tokenizer).

The conversion runs once per GGUF file and is cached (keyed by path, size and
mtime), so later starts load safetensors and tokenizer.json directly:
dequantizing the file and parsing its 49k-entry token arrays take seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time

import numpy as np

from enginecore.paths import default_cache_dir

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
CONVERTED_FORMAT_VERSION = 1

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (i, pair) -> (pair, i)."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def converted_dir_for(gguf_path: str, cache_dir: str | None = None) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{CONVERTED_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_dir or default_cache_dir(), "converted", f"{stem}-{digest}")


def ensure_converted(gguf_path: str, cache_dir: str | None = None, progress: bool = True) -> str:
    """The HF directory for a GGUF file, converting it on first use."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = converted_dir_for(gguf_path, cache_dir)
    if os.path.exists(os.path.join(out_dir, ".complete")):
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(out_dir))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        open(os.path.join(tmp, ".complete"), "w").close()
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def convert_gguf(gguf_path: str, out_dir: str, progress: bool = True) -> None:
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(gguf_path)
    fields = reader.fields

    def get(key: str, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path}; supported: "
            f"{sorted(SUPPORTED_GGUF_ARCHS)}"
        )
    n_heads = int(get(f"{arch}.attention.head_count"))
    n_kv = int(get(f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(get(f"{arch}.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab_tokens = get("tokenizer.ggml.tokens")
    config = {
        "architectures": [SUPPORTED_GGUF_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(get(f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(get(f"{arch}.rope.dimension_count", hidden // n_heads)),
        "vocab_size": int(get(f"{arch}.vocab_size", len(vocab_tokens))),
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    scaling_type = get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(get(f"{arch}.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: linear")

    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_QUANT_TYPES))
    if bad:
        raise ValueError(
            f"unsupported GGUF tensor types {bad} in {gguf_path}; "
            f"supported: {SUPPORTED_QUANT_TYPES}"
        )
    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress)
    for t in bar:
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            w = unpermute_rows(w, n_heads) if arch == "llama" else w
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            w = unpermute_rows(w, n_kv) if arch == "llama" else w
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _write_tokenizer(fields, get, out_dir)
    logger.info("converted %s in %.1f s", gguf_path, time.perf_counter() - t0)


def _write_tokenizer(fields, get, out_dir: str) -> None:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: gpt2 (BPE)")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    merges: list[str] = get("tokenizer.ggml.merges")
    types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    pre = get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits every digit on its own before the GPT-2 regex for these.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control, 4 = user defined: both are whole tokens.
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t == 3]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == 4]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    cfg = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": get("tokenizer.chat_template"),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
