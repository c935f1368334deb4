"""Runner for encoder (pooling) models: each request runs whole, in one step,
and finishes with its pooled vector. No KV cache is kept."""

from __future__ import annotations

import logging
import time

import torch

from enginecore.config import EngineConfig
from enginecore.model.bert import BertEncoder, load_bert_config, load_pooler_config, pool
from enginecore.model.hf_loader import iterate_weights
from enginecore.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PoolingModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        assert mc.model_path is not None
        self.config = config
        self.model_path = mc.model_path
        self.device = torch.device(mc.device)
        self.dtype = _TORCH_DTYPES[mc.dtype]
        self.cfg = load_bert_config(mc.model_path)
        self.pooler = load_pooler_config(mc.model_path)
        self.model: BertEncoder | None = None
        self.kv_caches: list = [True]  # nothing to allocate; truthy = "awake"
        logger.info("pooler: %s pooling, normalize=%s (from %s)", self.pooler.mode,
                    self.pooler.normalize, mc.model_path)

    def load_model(self) -> None:
        t0 = time.perf_counter()
        model = BertEncoder(self.cfg, self.dtype, self.device)
        model.load_weights(iterate_weights(self.model_path))
        self.model = model
        logger.info("loaded encoder %s (%.1f MiB) in %.2f s", self.model_path,
                    model.weight_bytes() / 2**20, time.perf_counter() - t0)

    def unload_model(self) -> None:
        self.model = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [True]

    def free_kv_cache(self) -> None:
        self.kv_caches = []

    def dummy_forward(self, num_tokens: int = 1) -> None:
        if self.model is not None:
            self.model.forward(torch.zeros(1, max(num_tokens, 1), dtype=torch.long,
                                           device=self.device), [max(num_tokens, 1)])

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        return {}

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.model is None:
            raise RuntimeError("the encoder is asleep (weights released)")
        seqs = {new.req_id: new.token_ids for new in so.scheduled_new_reqs}
        req_ids = list(so.num_scheduled_tokens)
        for rid in req_ids:
            if rid not in seqs or so.num_scheduled_tokens[rid] != len(seqs[rid]):
                raise RuntimeError(f"pooling request {rid} was not scheduled whole")
        lengths = [len(seqs[r]) for r in req_ids]
        Lmax = max(lengths)
        ids = torch.zeros(len(req_ids), Lmax, dtype=torch.long)
        for i, r in enumerate(req_ids):
            ids[i, : lengths[i]] = torch.tensor(seqs[r])
        hidden = self.model.forward(ids.to(self.device), lengths)
        vectors = pool(hidden, lengths, self.pooler).cpu().tolist()
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                                 [[] for _ in req_ids], pooler_output=vectors)
