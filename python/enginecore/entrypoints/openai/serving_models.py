"""The model names a server answers to: the base model's served names and the
LoRA adapters given with ``--lora-modules`` (each addressable as a model)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from enginecore.entrypoints.openai.errors import APIError
from enginecore.entrypoints.openai.protocol import ModelCard, ModelList, now
from enginecore.protocol import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...[, "base_model_name"]}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules {text!r}: JSON needs 'name' and 'path' ({e})") \
                from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return LoRAModulePath(name, path)


class ServingModels:
    def __init__(self, served_names: list[str], model_root: str, max_model_len: int,
                 lora_modules: list[LoRAModulePath] = ()) -> None:
        if not served_names:
            raise ValueError("a server needs at least one served model name")
        self.served_names = list(served_names)
        self.model_root = model_root
        self.max_model_len = max_model_len
        self.created = now()
        self.loras: dict[str, LoRARequest] = {}
        for i, mod in enumerate(lora_modules, start=1):
            if mod.name in self.served_names or mod.name in self.loras:
                raise ValueError(f"--lora-modules: the name {mod.name!r} is already taken")
            if not os.path.isdir(mod.path):
                raise ValueError(f"--lora-modules {mod.name}: {mod.path} is not a directory")
            self.loras[mod.name] = LoRARequest(mod.name, i, os.path.abspath(mod.path))

    @property
    def default_name(self) -> str:
        return self.served_names[0]

    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to answer with, the adapter) of a request's ``model`` field;
        no model means the first served name; an unknown one is a 404."""
        if model is None or model == "":
            return self.default_name, None
        if model in self.served_names:
            return model, None
        lora = self.loras.get(model)
        if lora is not None:
            return model, lora
        raise APIError(404, f"The model `{model}` does not exist.", "model")

    def model_list(self) -> ModelList:
        cards = [ModelCard(id=name, created=self.created, root=self.model_root, parent=None,
                           max_model_len=self.max_model_len) for name in self.served_names]
        cards += [ModelCard(id=name, created=self.created, root=lora.lora_path,
                            parent=self.default_name, max_model_len=self.max_model_len)
                  for name, lora in self.loras.items()]
        return ModelList(cards)
