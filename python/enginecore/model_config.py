"""ModelConfig: the model and the facts about it the engine needs.

Its own module (not config.py) so the loaders that fill it (model/model_info.py)
need nothing of EngineArgs, which calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

SYNTHETIC_MODEL = "synthetic"


@dataclass
class ModelConfig:
    """The model and the facts about it the engine needs (read from its files)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int = 2048
    vocab_size: int = 32000
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    architecture: str = SYNTHETIC_MODEL
    # Where the model's files resolved to (a directory or a .gguf file); None for synthetic.
    model_path: str | None = None
    # "generate" (decoders) or "embed" (encoders with a pooler).
    task: str = "generate"
    # Mixture of experts: data-parallel ranks then run in lockstep by default.
    is_moe: bool = False

    @property
    def is_synthetic(self) -> bool:
        return self.model == SYNTHETIC_MODEL
