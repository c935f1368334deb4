"""Tiny random-weight HF models made on the fly (transformers is the reference)."""

from __future__ import annotations

import os

import torch

# Family-specific settings of the tiny models: small enough windows, soft caps and
# rope limits that each difference from Llama changes the tokens.
TINY_KINDS = {
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                   attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                   hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3, pad_token_id=0),
    # LongRoPE over a partial rotary (8 of 16 dims): 4 short and 4 long factors.
    "phi3": dict(pad_token_id=0, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 2.1, 3.4],
                               "long_factor": [1.5, 2.5, 4.0, 6.0]}),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      mlp_only_layers=[1], head_dim=16),
}
_CLASSES = {"qwen3": "Qwen3", "gemma2": "Gemma2", "phi3": "Phi3", "mixtral": "Mixtral",
            "qwen3_moe": "Qwen3Moe"}


def make_tiny_model(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(TINY_KINDS.get(kind, {}))
    common.update(overrides)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        # Make the q/k/v biases matter.
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind in _CLASSES:
        name = _CLASSES[kind]
        cfg = getattr(transformers, name + "Config")(**common)
        model = getattr(transformers, name + "ForCausalLM")(cfg)
        with torch.no_grad():  # norms away from 1 (or 0 for Gemma): q/k and (1 + w) matter
            for n, p in model.named_parameters():
                if p.dim() == 1 and "norm" in n:
                    p.normal_(1.0 if kind != "gemma2" else 0.0, 0.3)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: sharper logits, fewer near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from transformers, full recompute each step (no cache tricks)."""
    key = (os.path.abspath(model_dir), tuple(prompt), max_tokens)
    if key not in _greedy:
        _greedy[key] = _hf_greedy(model_dir, prompt, max_tokens)
    return list(_greedy[key])


_greedy: dict[tuple, list[int]] = {}


def _hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = _load(model_dir)
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _load(model_dir)(torch.tensor([ids])).logits[0].float()


_cache: dict[str, object] = {}


def _load(model_dir: str):
    import transformers

    key = os.path.abspath(model_dir)
    if key not in _cache:
        _cache[key] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
    return _cache[key]


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                      "{% endfor %}{% if tools %}<s>tools\n{{ tools | tojson }}</s>\n{% endif %}"
                      "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
_CORPUS = ["The capital of France is Paris.", "héllo wörld, ça va? naïve café", "日本語のテキスト",
           "emoji 🎉🚀 and more", "def fibonacci(n): return n if n < 2 else n", "1, 2, 3, 4, 5"]


def make_tiny_tokenizer(path: str, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer (GPT-2 style, trained on a few lines; <unk>, <s>,
    </s> are ids 0-2) with a chat template, written into ``path``; its vocab size.
    Non-ASCII text spans several tokens, so multi-byte characters split across them."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TINY_CHAT_TEMPLATE},
                  f)
    return tok.get_vocab_size()


def make_tiny_chat_model(path: str, seed: int = 0, **overrides) -> str:
    """A tiny random llama with a byte-level tokenizer: the front-end's test model."""
    vocab = make_tiny_tokenizer(path)
    return make_tiny_model(path, seed=seed, vocab_size=vocab, **overrides)
