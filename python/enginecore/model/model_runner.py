"""ModelRunner: keeps per-request state, turns a SchedulerOutput into one
flattened forward pass over the paged KV cache, and samples."""

from __future__ import annotations

import importlib
import logging
import time

import numpy as np
import torch

from enginecore.config import EngineConfig
from enginecore.kv_transfer.worker_hooks import ConnectorWorker, layer_name
from enginecore.model.arch_config import LlamaArchConfig, load_arch_config
from enginecore.model.attention import make_attention_metadata
from enginecore.model.hf_loader import iterate_weights
from enginecore.model.llama import LlamaForCausalLM
from enginecore.model.lora import LoRABatch, LoRAError, LoRAWeights, load_lora
from enginecore.model.lora_slots import LoRASlots
from enginecore.model.mm_registry import MULTIMODAL_ARCHITECTURES, is_multimodal_architecture
from enginecore.model.mm_runner import MultiModalRunner
from enginecore.model.multimodal_interface import supports_multimodal
from enginecore.model.ngram_proposer import NgramProposer
from enginecore.model.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    greedy_argmax,
    plain_greedy_row,
)
from enginecore.protocol import LoRARequest
from enginecore.sampling_params import SamplingParams
from enginecore.sched.output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# prompt_logprobs: logits of at most this many prompt positions at once ([rows, vocab]
# float32 each), so a long prompt never materialises all its logits.
PROMPT_LOGPROBS_CHUNK = 256


class RequestState:
    __slots__ = ("req_id", "token_ids", "num_prompt", "params", "block_ids", "lora_id",
                 "eos_token_id", "prompt_lp", "mm_features")

    def __init__(self, req_id, token_ids, num_prompt, params, block_ids, lora_id=0,
                 eos_token_id=None, mm_features=None) -> None:
        self.mm_features = mm_features  # images and their placeholders, prompt order
        self.req_id = req_id
        self.token_ids: list[int] = token_ids
        self.num_prompt: int = num_prompt
        self.params: SamplingParams = params
        self.block_ids: list[int] = block_ids
        self.lora_id: int = lora_id
        self.eos_token_id: int | None = eos_token_id
        # prompt_logprobs gathered over the prefill's chunks: (ids, logprobs, ranks)
        # rows; None when not asked for, or already sent (a request resumed after a
        # preemption with outputs has sent them).
        self.prompt_lp: tuple[list, list, list] | None = (
            ([], [], []) if params.prompt_logprobs is not None and len(token_ids) == num_prompt
            else None)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        mc = config.model_config
        self.config = config
        self.device = torch.device(mc.device)
        self.dtype = _TORCH_DTYPES[mc.dtype]
        self.block_size = config.cache_config.block_size
        self.eos_token_id = mc.eos_token_id
        assert mc.model_path is not None
        self.model_path = mc.model_path
        self.arch: LlamaArchConfig = load_arch_config(mc.model_path)
        self.model: LlamaForCausalLM | None = None
        self.sampler = Sampler(self.arch.vocab_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.scratch_slot = 0
        self.scratch_block = 0
        self.requests: dict[str, RequestState] = {}
        self.mm: MultiModalRunner | None = None  # vision-language models only
        self.max_model_len = config.scheduler_config.max_model_len
        spec = config.speculative_config
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max) if spec.enabled else None)
        self._drafts: dict[str, list[int]] = {}
        self._grammar_bitmask: dict = {}
        lc = config.lora_config
        self.lora_config = lc
        self.loras: LoRASlots[LoRAWeights] = LoRASlots(lc.max_loras)
        # Every adapter ever added, so an evicted one can be loaded again on use.
        self.lora_requests: dict[int, LoRARequest] = {}
        # KV transfer: the worker-role connector's calls around the forward (None: none).
        self.kv_connector = ConnectorWorker.maybe_create(config)
        torch.manual_seed(mc.seed)

    # -- weights and cache -------------------------------------------------------------------
    def load_model(self) -> None:
        t0 = time.perf_counter()
        if is_multimodal_architecture(self.arch.architecture):
            module, name = MULTIMODAL_ARCHITECTURES[self.arch.architecture]
            model_class = getattr(importlib.import_module(module), name)
            model = model_class.from_model_dir(self.arch, self.model_path, self.dtype,
                                               self.device)
        else:
            model = LlamaForCausalLM(self.arch, self.dtype, self.device)
        model.load_weights(iterate_weights(self.model_path))
        self.model = model
        self.mm = MultiModalRunner(model, self.device) if supports_multimodal(model) else None
        logger.info("loaded %s (%s, %d layers, %.1f MiB, %s on %s) in %.2f s",
                    self.arch.architecture, self.model_path, self.arch.num_layers,
                    model.weight_bytes() / 2**20, self.dtype, self.device,
                    time.perf_counter() - t0)

    def unload_model(self) -> None:
        self.model = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor per layer, [slots, kv_heads, head_dim]; one extra
        block at the end is scratch for dummy batches and padding.

        The cache is left uninitialised (zeroing GiBs costs seconds at start-up):
        attention only reads slots a request wrote, and padded reads point at
        the scratch block, which is zeroed."""
        a = self.arch
        slots = (num_blocks + 1) * self.block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * self.block_size
        shape = (2, slots, a.num_kv_heads, a.head_dim)
        self.kv_caches = []
        by_layer = {}
        for i in range(a.num_layers):
            # K and V of a layer in one tensor (vLLM's layout for a KV connector).
            kv = torch.empty(shape, dtype=self.dtype, device=self.device)
            kv[:, self.scratch_slot:].zero_()
            self.kv_caches.append((kv[0], kv[1]))
            by_layer[layer_name(i)] = kv.view(2, num_blocks + 1, self.block_size,
                                              a.num_kv_heads, a.head_dim)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(by_layer)

    def free_kv_cache(self) -> None:
        self.kv_caches = []
        # Sleep gives memory back: the sampler's per-step scratch goes too (regrown on use).
        self.sampler.release_scratch()

    # -- one step --------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        reqs = self.requests
        mm = self.mm
        for rid in so.finished_req_ids:
            reqs.pop(rid, None)
            if mm is not None:
                mm.remove_request(rid)
        for rid in so.preempted_req_ids:
            reqs.pop(rid, None)
            if mm is not None:
                mm.remove_request(rid)
        for new in so.scheduled_new_reqs:
            lora_id = 0
            if new.lora_request is not None:
                lora_id = new.lora_request.lora_int_id
                self.lora_requests.setdefault(lora_id, new.lora_request)
            eos = new.eos_token_id if new.eos_token_id is not None else self.eos_token_id
            reqs[new.req_id] = RequestState(new.req_id, list(new.token_ids),
                                            new.num_prompt_tokens, new.sampling_params,
                                            list(new.block_ids), lora_id, eos,
                                            new.mm_features)
            if new.mm_features:
                if mm is None:
                    raise ValueError(f"{self.arch.architecture} takes no multimodal inputs")
                mm.add_request(new.req_id, new.num_prompt_tokens, new.mm_features)
        cached = so.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks:
                reqs[rid].block_ids.extend(blocks)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        kvc = self.kv_connector
        if so.total_num_scheduled_tokens == 0:
            if kvc is not None:
                return ModelRunnerOutput([], {}, [], kv_connector_output=kvc.no_forward(so))
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.model is None or not self.kv_caches:
            raise RuntimeError("the model runner is asleep (weights or KV cache released)")
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self._grammar_bitmask = so.grammar_bitmask
        input_ids, positions, meta, groups, lora_ranges, prompt_rows = self._prepare(so,
                                                                                     computed)
        lora = self._lora_batch(lora_ranges) if lora_ranges else None
        embeds = None
        if self.mm is not None:  # images: encode what is due, merge, M-RoPE positions
            self.mm.execute_encoders(so, self.requests)
            embeds, mrope_positions = self.mm.step_inputs(so, computed, self.requests, input_ids)
            if mrope_positions is not None:
                positions = mrope_positions
        if kvc is None:
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, lora,
                                        inputs_embeds=embeds)
        else:  # loads before, saves after each layer's attention
            kvc.start(so, meta)
            try:
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, lora,
                                            inputs_embeds=embeds, kv_hook=kvc)
            finally:
                kv_output = kvc.finish(so)
        req_ids = list(so.num_scheduled_tokens)
        if prompt_rows:
            self._gather_prompt_logprobs(hidden, prompt_rows)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs = None
        if groups:
            sampled, logprobs = self._sample(hidden, groups, req_ids)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                 logprobs, prompt_logprobs=self._finished_prompt_logprobs(groups)
                                 if prompt_rows else None,
                                 kv_connector_output=None if kvc is None else kv_output)

    def _gather_prompt_logprobs(self, hidden: torch.Tensor,
                                prompt_rows: list[tuple[RequestState, int, list[int]]]) -> None:
        """Logprobs of this step's prompt positions (their next prompt token), a
        bounded number of positions at a time, appended to each request's rows."""
        assert self.model is not None
        for st, first, targets in prompt_rows:
            n = st.params.prompt_logprobs
            acc = st.prompt_lp
            assert acc is not None and n is not None
            for s in range(0, len(targets), PROMPT_LOGPROBS_CHUNK):
                tgt = targets[s:s + PROMPT_LOGPROBS_CHUNK]
                idx = torch.arange(first + s, first + s + len(tgt), device=self.device)
                # The model's dtype: the logprob kernel widens bf16 as it reads.
                logits = self.model.compute_logits(hidden.index_select(0, idx), float32=False)
                ids, vals, ranks = self.sampler.prompt_logprobs(logits.cpu(), tgt, n)
                acc[0].extend(ids), acc[1].extend(vals), acc[2].extend(ranks)

    @staticmethod
    def _finished_prompt_logprobs(groups) -> dict[str, tuple[list, list, list]] | None:
        """The prompt logprobs of requests whose prefill ended this step (sent once)."""
        done = {}
        for _, _, st, _ in groups:
            if st.prompt_lp is not None:
                done[st.req_id], st.prompt_lp = st.prompt_lp, None
        return done or None

    def _sample(self, hidden: torch.Tensor, groups, req_ids: list[str]):
        """Sample every position of every group; with drafts, keep the drafts the
        target agrees with plus one token (rejection sampling for a one-hot
        draft distribution: sample t_j ~ p_j, accept while t_j == draft_j)."""
        assert self.model is not None
        flat: list[int] = []
        masks = self._grammar_bitmask
        greedy = True  # plain_greedy of the rows, before they are built (each copies ids)
        for first, _, st, drafts in groups:
            n_out = len(st.token_ids) - st.num_prompt
            for j in range(len(drafts) + 1):
                flat.append(first + j)
                greedy = greedy and plain_greedy_row(st.params, n_out + j, st.eos_token_id,
                                                     masks.get(st.req_id))
        idx = torch.tensor(flat, dtype=torch.long, device=self.device)
        if greedy:  # argmax of the model-dtype logits (sampler.py)
            logits = self.model.compute_logits(hidden.index_select(0, idx), float32=False)
            out = SamplerOutput(greedy_argmax(logits), [None] * len(flat))
        else:
            rows: list[SamplingRow] = []
            for _, _, st, drafts in groups:
                outputs = st.token_ids[st.num_prompt:]
                for j in range(len(drafts) + 1):
                    rows.append(SamplingRow(st.params, st.token_ids[: st.num_prompt],
                                            outputs + drafts[:j], len(st.token_ids) + j,
                                            st.eos_token_id, masks.get(st.req_id)))
            # The model's dtype: the sampler widens only what needs float32.
            logits = self.model.compute_logits(hidden.index_select(0, idx), float32=False)
            out = self.sampler(logits.cpu(), rows)
        sampled: list[list[int]] = [[] for _ in req_ids]
        want_lp = any(lp is not None for lp in out.logprobs)
        logprobs: list | None = [None] * len(req_ids) if want_lp else None
        k = 0
        for _, row, st, drafts in groups:
            emitted: list[int] = []
            for j in range(len(drafts) + 1):
                tok = out.token_ids[k + j]
                emitted.append(tok)
                if j == len(drafts) or tok != drafts[j]:
                    break
            if logprobs is not None and out.logprobs[k] is not None:
                lps = out.logprobs[k : k + len(emitted)]
                logprobs[row] = ([lp[0] for lp in lps], [lp[1] for lp in lps],
                                 [lp[2] for lp in lps])
            k += len(drafts) + 1
            st.token_ids.extend(emitted)
            sampled[row] = emitted
            if self.proposer is not None:
                n_out = len(st.token_ids) - st.num_prompt
                max_tokens = st.params.max_tokens  # None: up to max_model_len
                limit = self.max_model_len - len(st.token_ids) - 1
                if max_tokens is not None:
                    limit = min(limit, max_tokens - n_out - 1)
                draft = self.proposer.propose(st.token_ids, limit) if limit > 0 else []
                if draft:
                    self._drafts[st.req_id] = draft
        return sampled, logprobs

    # -- LoRA ----------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and validate) an adapter into a slot; raises LoRAError with the reason."""
        if not self.lora_config.enable_lora:
            raise LoRAError("LoRA is not enabled: start the engine with enable_lora=True")
        lid = lora_request.lora_int_id
        if lid in self.loras:
            self.loras.get(lid)
            return True
        weights = load_lora(lora_request.lora_path, lid, lora_request.lora_name, self.arch,
                            self.lora_config.max_lora_rank, self.dtype, self.device)
        evicted = self.loras.add(lid, weights)
        self.lora_requests[lid] = lora_request
        if evicted is not None:
            logger.info("LoRA %d evicted (LRU) to load %d", evicted, lid)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.lora_requests.pop(lora_id, None)
        return self.loras.remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.loras.pin(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.ids()

    def _lora_batch(self, ranges: dict[int, list[int]]) -> LoRABatch:
        groups = []
        for lid, tokens in ranges.items():
            weights = self.loras.get(lid)
            if weights is None:  # evicted since: load it again
                request = self.lora_requests.get(lid)
                if request is None:
                    raise LoRAError(f"LoRA {lid} is neither loaded nor known")
                self.add_lora(request)
                weights = self.loras.get(lid)
            idx = torch.tensor(tokens, dtype=torch.long, device=self.device)
            groups.append((idx, weights))
        return LoRABatch(groups)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        drafts, self._drafts = self._drafts, {}
        return drafts

    def _prepare(self, so: SchedulerOutput, computed: dict[str, int]):
        bs = self.block_size
        reqs = self.requests
        num_seqs = len(so.num_scheduled_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        states: list[RequestState] = []
        # (flat index of the first sampled position, request row, state, drafts)
        groups: list[tuple[int, int, RequestState, list[int]]] = []
        spec = so.scheduled_spec_decode_tokens
        lora_ranges: dict[int, list[int]] = {}
        # prompt_logprobs: (state, flat index of its first position, next prompt tokens)
        prompt_rows: list[tuple[RequestState, int, list[int]]] = []
        for row, (rid, n) in enumerate(so.num_scheduled_tokens.items()):
            st = reqs[rid]
            c = computed[rid]
            start = len(input_ids)
            if st.lora_id:
                lora_ranges.setdefault(st.lora_id, []).extend(range(start, start + n))
            drafts = spec.get(rid, ()) if spec else ()
            if n == 1:
                input_ids.append(st.token_ids[c])
                positions.append(c)
                slots.append(st.block_ids[c // bs] * bs + c % bs)
            else:
                if drafts:  # the last known token, then the drafts to verify
                    input_ids.extend(st.token_ids[c : c + n - len(drafts)])
                    input_ids.extend(drafts)
                else:
                    input_ids.extend(st.token_ids[c : c + n])
                pos = np.arange(c, c + n)
                blocks = np.asarray(st.block_ids, dtype=np.int64)
                positions.extend(range(c, c + n))
                slots.extend((blocks[pos // bs] * bs + pos % bs).tolist())
            if st.prompt_lp is not None:  # (none to score in a one-token prompt)
                end = min(c + n, st.num_prompt - 1)  # position p predicts token p + 1
                prompt_rows.append((st, start, st.token_ids[c + 1:end + 1]))
            query_start[row + 1] = start + n
            seq_lens[row] = c + n
            states.append(st)
            if c + n - len(drafts) >= len(st.token_ids):
                groups.append((start + n - 1 - len(drafts), row, st, list(drafts)))
        # Block tables padded with the scratch block (attention never reads past a
        # sequence's length; the twin's padded gathers read the zeroed scratch slot).
        max_blocks = -(-int(seq_lens.max()) // bs)
        table = np.full((num_seqs, max_blocks), self.scratch_block, dtype=np.int32)
        for i, st in enumerate(states):
            blocks = st.block_ids[:max_blocks]
            table[i, : len(blocks)] = blocks
        dev = self.device
        meta = make_attention_metadata(np.asarray(slots, dtype=np.int64), query_start, seq_lens,
                                       table, bs, self.scratch_slot, dev)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                meta, groups, lora_ranges, prompt_rows)

    @torch.inference_mode()
    def dummy_forward(self, num_tokens: int = 1) -> None:
        """A forward pass that touches no request's cache (writes the scratch block)."""
        if self.model is None or not self.kv_caches:
            return
        n = max(1, min(num_tokens, self.block_size))
        slots = np.arange(self.scratch_slot, self.scratch_slot + n)
        meta = make_attention_metadata(slots, np.array([0, n]), np.array([n]),
                                       np.array([[self.scratch_block]]), self.block_size,
                                       self.scratch_slot, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.model.forward(ids, torch.arange(n, device=self.device), meta, self.kv_caches)
