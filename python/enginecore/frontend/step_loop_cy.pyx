# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""The output processor's per-step loop, compiled (twin of ``step_loop.py``).

Same names, same semantics, same results bit for bit as the Python twin (the
tests run both and compare); read ``step_loop.py`` for the rules. What is
compiled: the request state is a C struct (``cdef class``) whose counters are C
ints, the per-output routing and bookkeeping are C code, and the stop-string
hold-back compares characters in place instead of slicing. The detokenizers and
output objects are shared with the Python twin. The module is not named
``step_loop``: an extension module of that name would shadow the ``.py`` file.
"""

from enginecore.frontend.detokenizer import ByteLevelDetokenizer
from enginecore.frontend.parallel_sampling import emit_parent_outputs
# Off the per-token path (once per request or rare): shared with the Python twin.
from enginecore.frontend.step_loop import note_events, pooling_output, take_prompt_logprobs
from enginecore.outputs import CompletionOutput, Logprob, RequestOutput
from enginecore.protocol import FinishReason

cdef int _CUMULATIVE = 0
cdef int _DELTA = 1
cdef int _FINAL_ONLY = 2
cdef object _STOP = FinishReason.STOP
cdef dict _FINISH_NAMES = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                           FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}


cdef class RequestState:
    """One engine request's front-end state (a child of a parent when ``n > 1``)."""

    cdef public str request_id
    cdef public str external_id
    cdef public int index
    cdef public object parent
    cdef public object queue
    cdef public object prompt
    cdef public list prompt_token_ids
    cdef public object lora_request
    cdef public int output_kind
    cdef public object detok
    cdef public list token_ids
    cdef public Py_ssize_t sent_tokens
    cdef public str tail
    cdef public str ctx
    cdef public object parts
    cdef public list stop
    cdef public Py_ssize_t max_stop_len
    cdef public bint include_stop
    cdef public Py_ssize_t min_tokens
    cdef public object logprobs
    cdef public Py_ssize_t sent_logprobs
    cdef public object cumulative_logprob
    cdef public object metrics
    cdef public bint pooling
    cdef public object token_text
    cdef public object prompt_logprobs
    # ByteLevel detokenizer, inlined: its byte table and its UTF-8 decoder's decode.
    cdef list _table
    cdef object _utf8_decode

    def __init__(self, request_id, external_id, index, parent, queue, prompt,
                 prompt_token_ids, lora_request, output_kind, detok, stop, include_stop,
                 min_tokens, want_logprobs, metrics, pooling, token_text):
        self.request_id = request_id
        self.external_id = external_id
        self.index = index
        self.parent = parent
        self.queue = queue
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.lora_request = lora_request
        self.output_kind = output_kind
        self.detok = detok
        self.token_ids = []
        self.sent_tokens = 0
        self.tail = ""
        self.ctx = ""
        self.parts = None if output_kind == _DELTA else []
        self.stop = stop
        self.max_stop_len = max(map(len, stop)) if stop else 0
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.logprobs = [] if want_logprobs else None
        self.sent_logprobs = 0
        self.cumulative_logprob = 0.0 if want_logprobs else None
        self.metrics = metrics
        self.pooling = pooling
        self.token_text = token_text
        if type(detok) is ByteLevelDetokenizer:
            self._table = detok.table
            self._utf8_decode = detok.utf8.decode


cdef str _decode(RequestState st, list ids):
    """``st.detok.decode(ids)``; for a ByteLevel detokenizer without the call: the
    tokens' bytes from the table straight into the same UTF-8 decoder."""
    cdef list table = st._table
    cdef Py_ssize_t n, t, i
    if table is None:
        return st.detok.decode(ids)
    n = len(table)
    if len(ids) == 1:
        t = ids[0]
        return st._utf8_decode(table[t] if 0 <= t < n else b"")
    parts = []
    for i in range(len(ids)):
        t = ids[i]
        parts.append(table[t] if 0 <= t < n else b"")
    return st._utf8_decode(b"".join(parts))


def find_stop(str window, Py_ssize_t check_from, list stop):
    """The stop string that ends first among those ending after ``check_from``
    in ``window``, and where it starts."""
    cdef object best = None
    cdef Py_ssize_t best_end = 0, i, end, start
    cdef str s
    for s in stop:
        start = check_from - len(s) + 1
        if start < 0:
            start = 0
        i = window.find(s, start)
        if i >= 0:
            end = i + len(s)
            if best is None or end < best_end:
                best = (s, i)
                best_end = end
    return best


def partial_stop_len(str text, list stop):
    """Length of the longest end of ``text`` that is a proper prefix of a stop string."""
    return _partial_stop_len(text, stop)


cdef Py_ssize_t _partial_stop_len(str text, list stop):
    cdef Py_ssize_t best = 0, k, j, n = len(text), base
    cdef str s
    cdef bint match
    for s in stop:
        k = len(s) - 1
        if k > n:
            k = n
        while k > best:
            base = n - k
            match = True
            for j in range(k):
                if text[base + j] != s[j]:
                    match = False
                    break
            if match:
                best = k
                break
            k -= 1
    return best


cdef tuple _detokenize(RequestState st, list new_ids, object finish, object stop_reason):
    cdef list ids = new_ids
    cdef Py_ssize_t n_ids, n_before, free
    cdef str head, new
    if (finish is _STOP and not st.include_stop and ids
            and (stop_reason is None or type(stop_reason) is int)):
        ids = ids[:len(ids) - 1]
    detok = st.detok
    n_ids = len(ids)
    n_before = len(st.token_ids) - len(new_ids)
    free = st.min_tokens - n_before
    if st.stop and 0 < free < n_ids:
        head = _decode(st, ids[:free])
        new = _decode(st, ids[free:])
    else:
        head = ""
        new = _decode(st, ids)
        if st.stop and free >= n_ids > 0:
            head = new
            new = ""
    if finish is not None:
        new = new + detok.flush()
    return head, new


cdef tuple _release(RequestState st, str head, str new, object finish, object stop_reason,
                    list aborts):
    cdef str ctx, window, pending, released, s
    cdef Py_ssize_t i, keep, keep_ctx, n_pend, n_joined
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
                aborts.append(st.request_id)
            finish = _STOP
            stop_reason = s
    pending = window[len(ctx):] if len(window) > len(ctx) else ""
    n_pend = len(pending)
    keep = 0 if finish is not None or st.include_stop else _partial_stop_len(pending, st.stop)
    released = pending[:n_pend - keep]
    st.tail = pending[n_pend - keep:]
    keep_ctx = st.max_stop_len - 1
    if keep_ctx > 0 and released:
        joined = ctx + released
        n_joined = len(joined)
        st.ctx = joined[n_joined - keep_ctx:] if n_joined > keep_ctx else joined
    return released, finish, stop_reason


cdef void _logprobs(RequestState st, object lps) except *:
    cdef list out = st.logprobs
    cdef double total = st.cumulative_logprob
    cdef Py_ssize_t r
    cdef list ids, vals
    text = st.token_text
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


cdef object _completion(RequestState st, str released, object finish_name, object stop_reason,
                        bint finished):
    cdef int kind = st.output_kind
    cdef list tokens, parts
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


def process_outputs(dict states, list outputs, double now, object iteration):
    """One step. ``states``: engine request id -> RequestState (finished ones are
    removed); ``iteration``: an IterationStats to fill, or None. Returns
    (outputs of requests without a queue, engine ids to abort, engine ids that
    finished)."""
    cdef list returned = []
    cdef list aborts = []
    cdef list finished_ids = []
    cdef list parents = []
    cdef RequestState st
    cdef list new_ids
    cdef Py_ssize_t n_new
    cdef bint finished, has_iter = iteration is not None
    cdef str released, head, new
    cdef object st_obj
    for o in outputs:
        st_obj = states.get(o.request_id)
        if st_obj is None:
            continue
        st = <RequestState>st_obj
        m = st.metrics
        events = o.events
        if events is not None:
            note_events(m, events)
        new_ids = o.new_token_ids
        finish = o.finish_reason
        n_new = len(new_ids)
        if n_new:
            if m.first_token_ts is None:
                m.first_token_ts = now
                if has_iter:
                    iteration.time_to_first_tokens.append(now - m.arrival_ts)
                    iteration.num_prompt_tokens += len(st.prompt_token_ids)
            elif has_iter:
                iteration.inter_token_latencies.append(now - m.last_token_ts)
            m.last_token_ts = now
            m.num_generation_tokens += n_new
            if has_iter:
                iteration.num_generation_tokens += n_new
            st.token_ids.extend(new_ids)
        elif finish is None:
            continue
        if st.pooling:
            del states[o.request_id]
            finished_ids.append(o.request_id)
            m.finished_ts = now
            out = pooling_output(st, o, finish)
            if has_iter:
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
        lps = o.new_logprobs
        if lps is not None and st.logprobs is not None:
            _logprobs(st, lps)
        if o.new_prompt_logprobs is not None:
            take_prompt_logprobs(st, o.new_prompt_logprobs)
        finished = finish is not None
        finish_name = None
        if finished:
            finish_name = _FINISH_NAMES[finish]
            del states[o.request_id]
            finished_ids.append(o.request_id)
            m.finished_ts = now
            if has_iter:
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

