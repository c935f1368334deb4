"""The output processor's per-step loop (pure-Python twin of ``step_loop_cy.pyx``).

Once per engine step, every ``EngineCoreOutput`` is routed to its request's
state: tokens appended, text detokenized incrementally, stop strings searched,
the releasable text (never a partial stop string) cut into the output of the
request's kind, logprobs given their decoded tokens, timing noted. Outputs go
to the request's queue (``AsyncLLM``) or into the returned list (``LLM``).

The Cython twin (``step_loop_cy.pyx``, same names, same results bit for bit) is
chosen by ``output_processor.step_loop_module()``. The names differ because an
extension module named ``step_loop`` would shadow this file on import.

Stop strings (vLLM semantics): a match must end in text that is new this step
(and after the first ``min_tokens`` tokens); of the matches, the one that ends
first wins (then the earlier in ``stop``), so the result does not depend on how
tokens were split into steps. The text is cut before the stop string, or after
it with ``include_stop_str_in_output``; ``stop_reason`` is the string and the
finish reason ``stop``. While a request runs, the longest end of its text that
could still become a stop string is held back (not with
``include_stop_str_in_output``, where a stop string is part of the text anyway).
A token that ends a request as EOS or a stop token id is not detokenized unless
``include_stop_str_in_output`` (vLLM).
"""

from __future__ import annotations

from enginecore.frontend.parallel_sampling import emit_parent_outputs
from enginecore.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from enginecore.protocol import EngineCoreEventType, FinishReason

_CUMULATIVE, _DELTA, _FINAL_ONLY = 0, 1, 2
_STOP = FinishReason.STOP
_FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                 FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}
_QUEUED = EngineCoreEventType.QUEUED
_SCHEDULED = EngineCoreEventType.SCHEDULED


class RequestState:
    """One engine request's front-end state (a child of a parent when ``n > 1``)."""

    __slots__ = ("request_id", "external_id", "index", "parent", "queue", "prompt",
                 "prompt_token_ids", "lora_request", "output_kind", "detok", "token_ids",
                 "sent_tokens", "tail", "ctx", "parts", "stop", "max_stop_len",
                 "include_stop", "min_tokens", "logprobs", "sent_logprobs",
                 "cumulative_logprob", "metrics", "pooling", "token_text", "prompt_logprobs")

    def __init__(self, request_id, external_id, index, parent, queue, prompt,
                 prompt_token_ids, lora_request, output_kind, detok, stop, include_stop,
                 min_tokens, want_logprobs, metrics, pooling, token_text) -> None:
        self.request_id = request_id
        self.external_id = external_id  # the caller's id (the parent's when n > 1)
        self.index = index
        self.parent = parent
        self.queue = queue
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.lora_request = lora_request
        self.output_kind = output_kind
        self.detok = detok  # None: no tokenizer, text stays ""
        self.token_ids = []
        self.sent_tokens = 0  # DELTA: tokens already returned
        self.tail = ""  # text not released yet (a possible stop string's start)
        self.ctx = ""  # the last max_stop_len - 1 released chars (stop search overlap)
        self.parts = None if output_kind == _DELTA else []  # released text (cumulative)
        self.stop = stop
        self.max_stop_len = max(map(len, stop)) if stop else 0
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.logprobs = [] if want_logprobs else None
        self.sent_logprobs = 0
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.metrics = metrics
        self.pooling = pooling
        self.token_text = token_text  # token id -> text (logprobs' decoded tokens)
        self.prompt_logprobs = None  # set once, when the engine sends them


def find_stop(window: str, check_from: int, stop: list[str]) -> tuple[str, int] | None:
    """The stop string that ends first among those ending after ``check_from``
    in ``window``, and where it starts."""
    best = None
    best_end = 0
    for s in stop:
        i = window.find(s, max(0, check_from - len(s) + 1))
        if i >= 0:
            end = i + len(s)
            if best is None or end < best_end:
                best, best_end = (s, i), end
    return best


def partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        k = min(len(s) - 1, len(text))
        while k > best:
            if text.endswith(s[:k]):
                best = k
                break
            k -= 1
    return best


def _detokenize(st, new_ids, finish, stop_reason):
    """Text this step adds, the stop string found (or None), and the finish."""
    ids = new_ids
    if (finish is _STOP and not st.include_stop and ids
            and (stop_reason is None or type(stop_reason) is int)):
        ids = ids[:-1]  # EOS / a stop token id: not part of the text
    detok = st.detok
    # Text of tokens within the first min_tokens never ends a stop string.
    n_before = len(st.token_ids) - len(new_ids)
    free = st.min_tokens - n_before
    if st.stop and 0 < free < len(ids):
        head = detok.decode(ids[:free])
        new = detok.decode(ids[free:])
    else:
        head = ""
        new = detok.decode(ids)
        if st.stop and free >= len(ids) > 0:
            head, new = new, ""
    if finish is not None:
        new += detok.flush()
    return head, new


def _release(st, head, new, finish, stop_reason, aborts):
    """Append this step's text, search stop strings, and release what is safe.
    Returns (released text, finish, stop_reason)."""
    if not st.stop:
        return head + new, finish, stop_reason
    ctx = st.ctx
    window = ctx + st.tail + head + new
    if new and len(st.token_ids) > st.min_tokens:
        found = find_stop(window, len(window) - len(new), st.stop)
        if found is not None:
            s, i = found
            window = window[:i + len(s)] if st.include_stop else window[:i]
            if finish is None:
                aborts.append(st.request_id)  # the engine does not know about it
            finish, stop_reason = _STOP, s
    pending = window[len(ctx):] if len(window) > len(ctx) else ""
    keep = 0 if finish is not None or st.include_stop else partial_stop_len(pending, st.stop)
    released = pending[:len(pending) - keep]
    st.tail = pending[len(pending) - keep:]
    keep_ctx = st.max_stop_len - 1
    if keep_ctx > 0 and released:
        st.ctx = (ctx + released)[-keep_ctx:]
    return released, finish, stop_reason


def _logprobs(st, lps):
    """Append one step's logprobs (sampled token first, then the top-N)."""
    out = st.logprobs
    text = st.token_text
    total = st.cumulative_logprob
    for ids, vals, rank in zip(lps.token_ids, lps.logprobs, lps.ranks):
        sampled = ids[0]
        entry = {sampled: Logprob(vals[0], rank, text(sampled))}
        for r in range(1, len(ids)):
            tid = ids[r]
            if tid not in entry:
                entry[tid] = Logprob(vals[r], r, text(tid))
        out.append(entry)
        total += vals[0]
    st.cumulative_logprob = total


def take_prompt_logprobs(st, lps):
    """The engine's prompt logprobs as vLLM returns them (None for the first prompt
    token, then token id -> Logprob per position), kept on the request, or on its
    parent when n > 1 (shared by both twins: once per request)."""
    text = st.token_text or _no_text
    out = [None]
    for ids, vals, rank in zip(lps.token_ids, lps.logprobs, lps.ranks):
        entry = {ids[0]: Logprob(vals[0], rank, text(ids[0]))}
        for r in range(1, len(ids)):
            if ids[r] not in entry:
                entry[ids[r]] = Logprob(vals[r], r, text(ids[r]))
        out.append(entry)
    if st.parent is not None:
        st.parent.prompt_logprobs = out
    else:
        st.prompt_logprobs = out


def _no_text(token_id):
    return None


def _completion(st, released, finish_name, stop_reason, finished):
    """This step's CompletionOutput for the request's output kind (None: nothing)."""
    kind = st.output_kind
    if kind == _DELTA:
        tokens = st.token_ids[st.sent_tokens:]
        st.sent_tokens = len(st.token_ids)
        lps = None
        if st.logprobs is not None:
            lps = st.logprobs[st.sent_logprobs:]
            st.sent_logprobs = len(st.logprobs)
        return CompletionOutput(st.index, released, tokens, st.cumulative_logprob, lps,
                                finish_name, stop_reason)
    parts = st.parts
    if released:
        parts.append(released)
    if kind == _FINAL_ONLY and not finished:
        return None
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return CompletionOutput(st.index, parts[0] if parts else "", list(st.token_ids),
                            st.cumulative_logprob,
                            None if st.logprobs is None else list(st.logprobs),
                            finish_name, stop_reason)


def note_events(m, events):
    """Scheduling events into the request's timing (shared by both twins: rare)."""
    for ev in events:
        if ev.type == _QUEUED:
            m.queued_ts = ev.timestamp
        elif ev.type == _SCHEDULED:
            if m.scheduled_ts is None:
                m.scheduled_ts = ev.timestamp
        else:
            m.num_preemptions += 1


def pooling_output(st, o, finish):
    """A pooling request's one output (shared by both twins: once per request)."""
    error = None if o.pooling_output is not None else (
        o.stop_reason if isinstance(o.stop_reason, str) else None)
    return EmbeddingRequestOutput(
        st.external_id, st.prompt, st.prompt_token_ids,
        None if o.pooling_output is None else EmbeddingOutput(o.pooling_output),
        True, _FINISH_NAMES[finish], error, st.metrics)


def process_outputs(states, outputs, now, iteration):
    """One step. ``states``: engine request id -> RequestState (finished ones are
    removed); ``iteration``: an IterationStats to fill, or None. Returns
    (outputs of requests without a queue, engine ids to abort, engine ids that
    finished)."""
    returned = []
    aborts = []
    finished_ids = []
    parents = []
    for o in outputs:
        st = states.get(o.request_id)
        if st is None:
            continue  # finished or aborted here already
        m = st.metrics
        if o.events is not None:
            note_events(m, o.events)
        new_ids = o.new_token_ids
        finish = o.finish_reason
        if new_ids:
            n_new = len(new_ids)
            if m.first_token_ts is None:
                m.first_token_ts = now
                if iteration is not None:
                    iteration.time_to_first_tokens.append(now - m.arrival_ts)
                    iteration.num_prompt_tokens += len(st.prompt_token_ids)
            elif iteration is not None:
                iteration.inter_token_latencies.append(now - m.last_token_ts)
            m.last_token_ts = now
            m.num_generation_tokens += n_new
            if iteration is not None:
                iteration.num_generation_tokens += n_new
            st.token_ids.extend(new_ids)
        elif finish is None:
            continue  # scheduling events only
        if st.pooling:
            del states[o.request_id]
            finished_ids.append(o.request_id)
            m.finished_ts = now
            out = pooling_output(st, o, finish)
            if iteration is not None:
                iteration.finished.append((m, out.finish_reason, len(st.prompt_token_ids)))
            if st.queue is not None:
                st.queue.put(out)
            else:
                returned.append(out)
            continue
        stop_reason = o.stop_reason
        released = ""
        if st.detok is not None:
            head, new = _detokenize(st, new_ids, finish, stop_reason)
            released, finish, stop_reason = _release(st, head, new, finish, stop_reason,
                                                     aborts)
        if o.new_logprobs is not None and st.logprobs is not None:
            _logprobs(st, o.new_logprobs)
        if o.new_prompt_logprobs is not None:
            take_prompt_logprobs(st, o.new_prompt_logprobs)
        finished = finish is not None
        finish_name = None
        if finished:
            finish_name = _FINISH_NAMES[finish]
            del states[o.request_id]
            finished_ids.append(o.request_id)
            m.finished_ts = now
            if iteration is not None:
                iteration.finished.append((m, finish_name, len(st.prompt_token_ids)))
        comp = _completion(st, released, finish_name, stop_reason, finished)
        parent = st.parent
        if parent is None:
            if comp is None:
                continue
            plp = st.prompt_logprobs
            if plp is not None and st.output_kind == _DELTA:
                st.prompt_logprobs = None  # sent once
            out = RequestOutput(st.external_id, st.prompt, st.prompt_token_ids, [comp],
                                finished, o.num_cached_tokens, m, st.lora_request, plp)
            if o.kv_transfer_params is not None:
                out.kv_transfer_params = o.kv_transfer_params
            if st.queue is not None:
                st.queue.put(out)
            else:
                returned.append(out)
            continue
        if finished:
            parent.num_unfinished -= 1
            parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if parent.output_kind == _FINAL_ONLY:
                parent.final[st.index] = comp
        if comp is not None and parent.output_kind != _FINAL_ONLY:
            parent.step_outputs.append(comp)
        if not parent.touched:
            parent.touched = True
            parents.append(parent)
    if parents:
        emit_parent_outputs(parents, now, returned)
    return returned, aborts, finished_ids

