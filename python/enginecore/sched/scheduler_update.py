"""The scheduler's results half (mixed into Scheduler): ``update_from_output``
appends sampled tokens, applies the stop checks in vLLM's order, frees finished
requests and builds each client's outputs: a ``ColumnarOutputs`` per client on
both paths (``.outputs`` is the typed view; the encoder writes msgpack from the
columns, natively or through its twin ``serial.encode_columnar_py``).
The plain-decode loop is ``update_decodes`` (sched/scheduler_loops.py, native in
csrc/scheduler_loops.cpp); one request that makes either loop raise ends alone
with ERROR."""

from __future__ import annotations

import logging
from typing import Any

from enginecore.protocol import EngineCoreOutput, FinishReason, Logprobs
from enginecore.request import Request, RequestStatus
from enginecore.sched.columnar_outputs import ColumnarOutputs
from enginecore.sched.encoder_scheduling import free_computed_encoder_inputs
from enginecore.sched.output import ModelRunnerOutput, SchedulerOutput
from enginecore.sched.request_table import NOT_STOPPED, STOP_TOKEN

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED


class SchedulerUpdate:
    """``self`` is the Scheduler."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> dict[int, ColumnarOutputs]:
        """Append sampled tokens, apply stop checks, free finished requests and
        build the outputs for each client."""
        if self.kv_hooks is not None:
            self._update_from_kv_xfer(model_output)
        requests = self.requests
        sampled = model_output.sampled_token_ids
        index_of = model_output.req_id_to_index
        logprobs = model_output.logprobs
        pooled = model_output.pooler_output
        prompt_lps = model_output.prompt_logprobs
        spec = scheduler_output.scheduled_spec_decode_tokens
        in_flight = self.in_flight if self.track_in_flight else None
        owed_outputs = self.pending_outputs
        self.pending_outputs = {}
        stopped: list[Request] = []
        # Plain decode outputs are two column appends; the rest stay objects in them.
        cols: dict[int, ColumnarOutputs] = {}
        for client, owed in owed_outputs.items():
            col = cols[client] = ColumnarOutputs()
            for out in owed:
                col.append_output(out)
        last_client = -1
        col_ids: list[str | None] = []
        col_toks: list = []

        failed: list[tuple[str, str]] = []
        if not spec and logprobs is None and pooled is None and prompt_lps is None:
            # Plain decodes: the whole loop native (csrc/scheduler_loops.cpp) or its twin.
            upd = self._update_decodes(
                self.request_table, self.slot_of, scheduler_output.num_scheduled_tokens,
                sampled, model_output.req_ids, index_of, in_flight, self.max_model_len)
            self._apply_decode_update(upd, cols, stopped, failed)
            scheduled: Any = ()
        else:
            scheduled = scheduler_output.num_scheduled_tokens
        for rid in scheduled:
            # One request that makes this loop raise fails alone (ERROR), as in C++.
            try:
                if in_flight is not None:
                    in_flight.discard(rid)
                request = requests.get(rid)
                if request is None or request.status != _RUNNING:
                    continue  # aborted or preempted while its batch ran
                i = index_of.get(rid)
                if pooled is not None and i is not None and pooled[i] is not None:
                    request.status = _STOPPED
                    stopped.append(request)
                    out = EngineCoreOutput(rid, [], finish_reason=FinishReason.STOP,
                                           pooling_output=pooled[i])
                    self._emit(cols, request, out)
                    continue
                new_token_ids = sampled[i] if i is not None else []
                drafts = spec.get(rid)
                if drafts:
                    # Rejected drafts were counted as computed: take them back.
                    request.num_computed_tokens -= len(drafts) + 1 - len(new_token_ids)
                    self.spec_num_draft_tokens += len(drafts)
                    self.spec_num_accepted_tokens += len(new_token_ids) - 1
                    self._count_accepted_per_pos(len(drafts), len(new_token_ids) - 1)
                if not new_token_ids:
                    continue
                prompt_lp = None if prompt_lps is None else prompt_lps.get(rid)
                if (len(new_token_ids) == 1 and request.grammar is None and prompt_lp is None
                        and (logprobs is None or logprobs[i] is None)):  # type: ignore[index]
                    request.append_output_token_ids(new_token_ids)
                    if self._check_stop(request):
                        stopped.append(request)
                        self._emit_finished(request, rid, new_token_ids, cols)
                    else:
                        client = request.client_index
                        if client != last_client:
                            col = cols.get(client)
                            if col is None:
                                col = cols[client] = ColumnarOutputs()
                            col_ids, col_toks = col.request_ids, col.new_token_ids
                            last_client = client
                        col_ids.append(rid)
                        col_toks.append(new_token_ids)
                    continue
                self._update_request(request, rid, new_token_ids,
                                     None if logprobs is None
                                     else logprobs[i],  # type: ignore[index]
                                     cols, stopped, prompt_lp)
            except Exception as e:  # noqa: BLE001 - that request's failure only
                failed.append((rid, f"{type(e).__name__}: {e}"))
                last_client = -1
        if failed:
            self._fail_updates(failed, cols, stopped)
        if self.encoder_cache_manager.refs:
            # Images whose placeholders are all in the KV cache now: their entries
            # become freeable once no other request needs them.
            for rid in list(self.encoder_cache_manager.refs):
                request = requests.get(rid)
                if request is not None:
                    free_computed_encoder_inputs(request, self.encoder_cache_manager)

        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
            for request in stopped:
                self._free_request(request)

        if self.log_stats:
            stats = self.make_stats()
            first = cols.get(0) or next(iter(cols.values()), None)
            if first is None:
                first = cols[0] = ColumnarOutputs()
            first.scheduler_stats = stats
        return cols

    def _apply_decode_update(self, upd: Any, cols: dict[int, ColumnarOutputs],
                             stopped: list[Request], failed: list[tuple[str, str]]) -> None:
        """Fold what ``update_decodes`` returned into the step's outputs."""
        plain, deferred, finished, loop_failed = upd
        for client, (ids, toks) in plain.items():
            col = cols.get(client)
            if col is None:
                col = cols[client] = ColumnarOutputs()
            if col.request_ids:
                col.request_ids.extend(ids)
                col.new_token_ids.extend(toks)
            else:  # the columns are the loop's lists
                col.request_ids, col.new_token_ids = ids, toks
        requests = self.requests
        for rid, toks, stop_token in finished:
            request = requests[rid]
            if stop_token is not None:
                request.stop_reason = stop_token
            stopped.append(request)
            self._emit_finished(request, rid, toks, cols)
        for rid, toks in deferred:
            try:
                self._update_request(requests[rid], rid, toks, None, cols, stopped)
            except Exception as e:  # noqa: BLE001 - that request's failure only
                failed.append((rid, f"{type(e).__name__}: {e}"))
        failed.extend(loop_failed)

    def _count_accepted_per_pos(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        per_pos = self.spec_num_accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1

    def _fail_updates(self, failed: list[tuple[str, str]],
                      cols: dict[int, ColumnarOutputs], stopped: list[Request]) -> None:
        """Requests whose update raised (both paths): each ends with ERROR and the
        exception, once (one that got its finish before raising keeps it)."""
        for rid, why in failed:
            request = self.requests.get(rid)
            if request is None:
                continue
            logger.error("request %r: processing its step output raised %s; it ends with "
                         "ERROR", rid, why)
            client = request.client_index
            owed = cols[client].specials if client in cols else ()
            if any(o.request_id == rid and o.finish_reason is not None for o in owed):
                continue
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = f"the engine could not process its output: {why}"
            if all(r is not request for r in stopped):
                stopped.append(request)
            self._emit(cols, request, EngineCoreOutput(
                rid, [], finish_reason=FinishReason.ERROR, stop_reason=request.stop_reason))

    def _update_request(self, request: Request, rid: str, new_token_ids: list[int],
                        lp: Any, cols: dict[int, ColumnarOutputs],
                        stopped: list[Request], prompt_lp: Any = None) -> None:
        """A request that is not a plain decode: grammar, several tokens (spec
        decode), logprobs, prompt logprobs (Python loop only). Shared by both paths."""
        grammar = request.grammar
        # A finished grammar allows only EOS, which it does not consume.
        if (grammar is not None and request.grammar_error is None and not grammar.is_stopped()
                and not grammar.consume_tokens(new_token_ids)):
            request.grammar_error = (f"token {new_token_ids} rejected by its constraint: "
                                     f"{grammar.get_error()}")
        if request.grammar_error is not None:
            logger.warning("request %r ends with ERROR: %s", rid, request.grammar_error)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = request.grammar_error
            stopped.append(request)
            self._emit_finished(request, rid, [], cols)
            return
        stop = False
        kept = 0
        for tok in new_token_ids:
            request.append_output_token_ids([tok])
            kept += 1
            if self._check_stop(request):
                stop = True
                break
        if kept < len(new_token_ids):
            new_token_ids = new_token_ids[:kept]
        new_logprobs = None
        if lp is not None:
            n = len(new_token_ids)
            new_logprobs = Logprobs(lp[0][:n], lp[1][:n], lp[2][:n])
        prompt_logprobs = None if prompt_lp is None else Logprobs(*prompt_lp)
        if stop:
            stopped.append(request)
            self._emit_finished(request, rid, new_token_ids, cols, new_logprobs,
                                prompt_logprobs)
            return
        out = EngineCoreOutput(rid, new_token_ids, new_logprobs,
                               new_prompt_logprobs=prompt_logprobs)
        self._emit(cols, request, out)

    def _emit_finished(self, request: Request, rid: str, new_token_ids: list[int],
                       cols: dict[int, ColumnarOutputs], new_logprobs: Any = None,
                       prompt_logprobs: Logprobs | None = None) -> None:
        out = EngineCoreOutput(
            rid, new_token_ids, new_logprobs, RequestStatus.finish_reason(request.status),
            request.stop_reason, max(request.num_cached_tokens, 0),
            new_prompt_logprobs=prompt_logprobs,
            kv_transfer_params=self._connector_finished(request))
        self._emit(cols, request, out)

    def _update_from_kv_xfer(self, model_output: ModelRunnerOutput) -> None:
        """Finished sends free their delayed blocks; finished receives let their
        requests be admitted (kv_transfer/sched_hooks.py)."""
        kv_output = model_output.kv_connector_output
        for rid in self.kv_hooks.update_from_output(kv_output):
            request = self.requests.get(rid)
            if request is not None:
                self._free_blocks(request)
        if kv_output is not None and kv_output.invalid_block_ids:
            self._kv_load_failed(kv_output.invalid_block_ids)

    def _kv_load_failed(self, bad_blocks: set[int]) -> None:
        """Blocks the connector could not load: their requests' step is void. Under
        kv_load_failure_policy "fail" they end with ERROR; under "recompute" they go
        back to waiting and compute what they cannot load (the blocks leave the prefix
        cache first)."""
        kv = self.kv_cache_manager
        self._kv_async_load_failed(bad_blocks)
        hit = [r for r in self.running if bad_blocks.intersection(kv.get_block_ids(r))]
        if not hit:
            return
        if self.kv_hooks.fail_on_load_error:
            for r in hit:
                kv.uncache_from(r, 0)
            self.finish_requests([r.request_id for r in hit], RequestStatus.FINISHED_ERROR,
                                 "its KV cache could not be loaded by the KV connector "
                                 "(kv_load_failure_policy 'fail')")
            return
        gone = {id(r) for r in hit}
        self.running = [r for r in self.running if id(r) not in gone]
        for r in hit:
            logger.warning("request %s: KV load failed; it is recomputed", r.request_id)
            kv.uncache_from(r, 0)
            r.num_cached_tokens = -1
            self._preempt(r)

    def _kv_async_load_failed(self, bad_blocks: set[int]) -> None:
        """Requests in WAITING_FOR_REMOTE_KVS whose asynchronous load failed (a P/D
        producer died, an offload copy failed): "fail" ends them with ERROR; "recompute"
        starts them over (from their local prefix-cache hits) once the connector
        reports the load over."""
        hooks, kv = self.kv_hooks, self.kv_cache_manager
        hit: dict[str, int] = {}
        for rid in hooks.waiting_for_remote:
            request = self.requests.get(rid)
            if request is None:
                continue
            ids = kv.get_block_ids(request)
            first_bad = next((i for i, b in enumerate(ids) if b in bad_blocks), None)
            if first_bad is not None:
                hit[rid] = first_bad
        if not hit:
            return
        if hooks.fail_on_load_error:
            self.finish_requests(list(hit), RequestStatus.FINISHED_ERROR,
                                 "its KV cache could not be loaded by the KV connector "
                                 "(kv_load_failure_policy 'fail')")
            return
        hooks.failed_recv.update(hit)

    @staticmethod
    def _emit(cols: dict[int, ColumnarOutputs], request: Request,
              out: EngineCoreOutput) -> None:
        """An output that is not a plain decode: the object, in its client's columns."""
        col = cols.get(request.client_index)
        if col is None:
            col = cols[request.client_index] = ColumnarOutputs()
        col.append_output(out)

    def take_pending_outputs(self) -> dict[int, ColumnarOutputs]:
        """Outputs owed outside a model step (aborts, rejections), as step outputs are."""
        pending, self.pending_outputs = self.pending_outputs, {}
        result: dict[int, ColumnarOutputs] = {}
        for client, owed in pending.items():
            col = result[client] = ColumnarOutputs()
            for out in owed:
                col.append_output(out)
        return result

    def _check_stop(self, request: Request) -> bool:
        """The stop checks on the request's last token (the table's, as the loops')."""
        why = request.table.check_stop(request.slot, self.max_model_len)
        if why == STOP_TOKEN:
            request.stop_reason = request.table.get_token_ids(request.slot)[-1]
        return why != NOT_STOPPED
