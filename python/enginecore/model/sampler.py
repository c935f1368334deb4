"""Token sampling for one step: allowed token ids, bad words, logit bias,
penalties, greedy / temperature, top-k, top-p, min-p, per-request seeds, and
top-N logprobs (of sampled and of prompt positions).

A random draw is the exponential race (argmax of p / E, E ~ Exp(1)) with each
row's E hashed from one key (``sample_rows``: natively in one pass over the row,
its twin in torch on the same bits). Seeded requests key their row by (seed,
position), so a seed gives the same tokens whatever the batch around it, and
after a preemption.
Logprobs are of the raw model distribution (log_softmax of the logits, before
penalties and temperature), as in vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore import _native
from enginecore.model.scratch import ScratchTensor
from enginecore.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    position: int  # index the sampled token will have in the sequence
    eos_token_id: int | None
    # Structured outputs: allowed tokens as int32 bit words (bit i of word w = token 32w+i).
    allowed_bitmask: object | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (token ids rows, logprob rows, ranks) for one sampled position, or None.
    logprobs: list[tuple[list[int], list[float], int] | None]


# dtype codes of the native kernels (csrc/cpu_kernels.h DType)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def plain_greedy(rows: list[SamplingRow]) -> bool:
    """Every row takes the argmax of the raw logits: greedy, and nothing that reads
    or changes the logits first (logprobs, penalties, bias, allowed / bad words,
    grammar masks, min_tokens still banning EOS or stop tokens)."""
    return all(plain_greedy_row(r.params, len(r.output_ids), r.eos_token_id, r.allowed_bitmask)
               for r in rows)


def plain_greedy_row(p: SamplingParams, num_outputs: int, eos_token_id: int | None,
                     allowed_bitmask: object | None) -> bool:
    """``plain_greedy`` for one row, from what it reads of the row (the runner asks
    before it builds the rows: they copy each request's ids)."""
    return p.greedy and _plain_row(p, num_outputs, eos_token_id, allowed_bitmask)


def _plain_row(p: SamplingParams, num_outputs: int, eos_token_id: int | None,
               allowed_bitmask: object | None, logprobs_ok: bool = False) -> bool:
    """Nothing reads or changes the row's logits before its draw: no logprobs (unless
    ``logprobs_ok``), penalties, bias, allowed / bad words, grammar mask, or min_tokens
    still banning EOS or stop tokens."""
    if ((p.logprobs is not None and not logprobs_ok) or p.has_penalties or p.logit_bias
            or p.allowed_token_ids is not None or p.bad_words_token_ids
            or allowed_bitmask is not None):
        return False
    return not (num_outputs < p.min_tokens and (
        p.stop_token_ids or (eos_token_id is not None and not p.ignore_eos)))


def _draws_from_the_model_logits(r: SamplingRow, vocab: int) -> bool:
    """The row's token comes from the model's logits as they are: their argmax, or
    the race over them divided by the temperature (no top-k, top-p or min-p); its
    logprobs are of those logits too. Such rows need no float32 copy of bf16 logits
    (the kernels widen, and divide by the temperature, as they read)."""
    p = r.params
    if not _plain_row(p, len(r.output_ids), r.eos_token_id, r.allowed_bitmask,
                      logprobs_ok=True):
        return False
    return p.greedy or not (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0)


def greedy_argmax_torch(logits: torch.Tensor) -> list[int]:
    """The first index of each row's maximum (torch.argmax, NaN the maximum)."""
    return logits.argmax(dim=-1).tolist()


def greedy_argmax(logits: torch.Tensor) -> list[int]:
    """Greedy tokens of [rows, vocab] logits in the model dtype: native on the CPU
    for float32 / bfloat16 (one pass, no float32 copy), else the twin."""
    ext = _native.extension()
    if (ext is None or logits.device.type != "cpu" or logits.dtype not in _DTYPE_CODES
            or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0):
        return greedy_argmax_torch(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ext.greedy_argmax(*greedy_argmax_args(logits, out))
    return out.tolist()


def greedy_argmax_args(logits: torch.Tensor, out: torch.Tensor) -> tuple:
    """What ``_C.greedy_argmax`` (and ``kernel_twins.greedy_argmax_py``) take."""
    return (logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
            out.data_ptr(), _DTYPE_CODES[logits.dtype], torch.get_num_threads())


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def race_uniforms(keys: torch.Tensor, cols: int) -> torch.Tensor:
    """[rows, cols] float64 u_j in (0, 1) of each row's key, as csrc/cpu_kernels_sample_impl.h
    hashes them: splitmix64's finalizer of key + (j + 1) * golden (int64 words, wrapping
    products), its top 52 bits k, u = (k + 0.5) * 2^-52 (exact)."""
    j = torch.arange(1, cols + 1, dtype=torch.int64, device=keys.device)
    z = keys.to(torch.int64)[:, None] + j[None, :] * _signed64(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed64(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed64(_MIX2)
    z = z ^ _shr(z, 31)
    return (_shr(z, 12).to(torch.float64) + 0.5) * 2.0**-52


def sample_rows_torch(logits: torch.Tensor, keys: torch.Tensor,
                      temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The draw of ``_C.sample_rows`` in torch: per row x of ``logits`` in float32
    (bf16 widened exactly), divided by ``temperature`` (float32, one per row) when
    given, -inf dropped: the exponential race argmax_j exp(x_j - max) / E_j in float64
    with E_j = -log(u_j), u_j = ``race_uniforms(keys)`` (the kernel's bits); a row whose
    max is NaN or infinite gives its argmax. torch's exp / log against the kernel's:
    a few double ulp apart, so the two differ only where two ratios tie that closely."""
    logits = logits.float()
    if temperature is not None:
        _check_temperature(logits, temperature)
        logits = logits / temperature.to(device=logits.device, dtype=torch.float32)[:, None]
    top = logits.argmax(dim=-1)
    m = logits.gather(1, top[:, None]).double()
    w = torch.exp(logits.double() - m)
    ratio = w / -torch.log(race_uniforms(keys.to(logits.device), logits.shape[1]))
    return torch.where(torch.isfinite(m[:, 0]), ratio.argmax(dim=-1), top)


def _check_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    _check_per_row(logits, temperature, "temperature")
    t = temperature.to(torch.float32)
    if not bool(((t > 0) & (t < float("inf"))).all()):
        raise ValueError("every temperature must be a positive finite number")


def _check_per_row(logits: torch.Tensor, per_row: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or tuple(per_row.shape) != (logits.shape[0],):
        raise ValueError(f"{name} must hold one value per row of [rows, vocab] logits: "
                         f"{list(per_row.shape)} for logits {list(logits.shape)}")


def _native_for_rows(logits: torch.Tensor, bf16: bool = False):
    """The extension where it runs these [rows, vocab] logits (float32, or bf16 where
    the kernel reads it; CPU), else None."""
    ext = _native.extension()
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    if (ext is None or logits.device.type != "cpu" or logits.dtype not in dtypes
            or logits.shape[1] == 0):
        return None
    return ext


def _reads_rows(logits: torch.Tensor) -> bool:
    """The row kernels read ``logits`` in place: unit column stride, rows that do not
    overlap (not broadcast with stride 0)."""
    return logits.stride(-1) == 1 and (logits.shape[0] <= 1 or logits.stride(0) >= logits.shape[1])


def sample_rows(logits: torch.Tensor, keys: torch.Tensor,
                temperature: torch.Tensor | None = None) -> torch.Tensor:
    """``sample_rows_torch``'s draw, natively for float32 or bf16 CPU rows (int64
    tokens): with ``temperature`` the kernel divides as it reads, so the model's bf16
    logits need no float32 copy and no scaled one."""
    _check_per_row(logits, keys, "keys")
    ext = _native_for_rows(logits, bf16=True)
    if ext is None:
        return sample_rows_torch(logits, keys, temperature)
    if not _reads_rows(logits):
        logits = logits.contiguous()
    keys = keys.to(torch.int64).contiguous()
    if temperature is not None:
        _check_per_row(logits, temperature, "temperature")
        temperature = temperature.to(torch.float32).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ext.sample_rows(*sample_rows_args(logits, keys, out, temperature))
    return out


def sample_rows_args(logits: torch.Tensor, keys: torch.Tensor, out: torch.Tensor,
                     temperature: torch.Tensor | None = None) -> tuple:
    """What ``_C.sample_rows`` (and ``kernel_twins.sample_rows_py``) take."""
    return (logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
            _DTYPE_CODES[logits.dtype], 0 if temperature is None else temperature.data_ptr(),
            keys.data_ptr(), out.data_ptr(), torch.get_num_threads())


def top_p_rows_torch(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p as ``_C.top_p_rows`` does it (a new tensor here): rank each row by (logit
    desc, index asc) and drop (-inf) every token whose more likely tokens weigh >= p
    of the row, weights exp(logit - max) in float64 (vLLM's rule "drop while the
    ascending cumulative probability <= 1 - p", in exact arithmetic); a row whose max
    is NaN or infinite, or whose p is 1, is left alone. Sums in another order than the
    kernel's: ~1e-16."""
    return logits.masked_fill(~_top_p_keep(logits, top_p), float("-inf"))


def _top_p_keep(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    m = logits.max(dim=-1, keepdim=True).values.double()
    order = logits.argsort(dim=-1, descending=True, stable=True)
    w = torch.exp(logits.double() - m).gather(1, order)
    cum = w.cumsum(dim=-1)
    above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    p = top_p.to(device=logits.device, dtype=torch.float64)[:, None]
    keep = torch.empty_like(order, dtype=torch.bool).scatter_(1, order, above < p * cum[:, -1:])
    keep |= ~torch.isfinite(m) | (p >= 1)
    return keep


def top_p_rows(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p_rows_torch``'s mask, natively (on a copy) for float32 CPU rows."""
    _check_per_row(logits, top_p, "top_p")
    if _native_for_rows(logits) is None:
        return top_p_rows_torch(logits, top_p)
    return top_p_rows_(logits.contiguous().clone(), top_p)


def top_p_rows_(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p_rows`` in place (the sampler's own scaled logits: no 12 MB copy a step)."""
    _check_per_row(logits, top_p, "top_p")
    ext = _native_for_rows(logits)
    if ext is None:
        return logits.masked_fill_(~_top_p_keep(logits, top_p), float("-inf"))
    if not _reads_rows(logits):
        return logits.copy_(top_p_rows(logits, top_p))
    p = top_p.to(torch.float64).contiguous()
    ext.top_p_rows(*top_p_rows_args(logits, p))
    return logits


def top_p_rows_args(logits: torch.Tensor, top_p: torch.Tensor) -> tuple:
    """What ``_C.top_p_rows`` (and ``kernel_twins.top_p_rows_py``) take."""
    return (logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
            top_p.data_ptr(), torch.get_num_threads())


def _order_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 values ``x`` at column ``index``, unique in a row, whose
    descending order is (x desc, index asc) with NaN above +inf and -0 below +0: the
    kernel's ``order_key`` (the float's bits made monotone) over 32 bits, 2^32 - 1 -
    index under them."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)
    key = torch.where(torch.isnan(x), torch.full_like(key, 0xFFC00000), key)
    return ((key - (1 << 31)) << 32) | (0xFFFFFFFF - index)


def _top_n_ids(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` column ids of each row of ``x`` in (x desc, index asc) order
    (``_order_keys``). Only the values >= each row's n-th largest are keyed and sorted
    (ties at the boundary are common in widened bf16); a NaN anywhere keys the rows."""
    if n == 0 or x.shape[0] == 0 or bool(torch.isnan(x).any()):
        cols = torch.arange(x.shape[1], device=x.device, dtype=torch.int64).expand_as(x)
        return _order_keys(x, cols).topk(n, dim=-1).indices
    nth = x.topk(n, dim=-1).values[:, -1:]
    k = int((x >= nth).sum(dim=-1).max())  # the n-th value's ties included
    vals, ids = x.topk(k, dim=-1)
    order = _order_keys(vals, ids).topk(n, dim=-1).indices
    return ids.gather(1, order)


def logprob_rows_torch(logits: torch.Tensor, tokens: torch.Tensor, n: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token logprobs [R] float32, ranks [R] int64, top ids [R, n] int64, top logprobs
    [R, n] float32) of each row x of ``logits`` (float32; bf16 widened), as
    ``_C.logprob_rows`` computes them: lp = (x - max) - log(sum exp(x - max)) in float64
    rounded once (NaN where the max is NaN or infinite), the rank of token t 1 + the
    count of x_j > x_t, the top n in (x desc, index asc) order (NaN first). Sums in
    another order than the kernel's: ~1e-16 apart before the rounding."""
    x = logits.float()
    _check_top_n(x, n)
    t = tokens.to(device=x.device, dtype=torch.int64)[:, None]
    if t.numel() and not bool(((t >= 0) & (t < x.shape[1])).all()):
        raise ValueError("every token must be in [0, vocab)")
    m = x.gather(1, x.argmax(dim=-1, keepdim=True)).double()
    log_sum = torch.log(torch.exp(x.double() - m).sum(dim=-1, keepdim=True))

    def lp(ids: torch.Tensor) -> torch.Tensor:
        v = ((x.gather(1, ids).double() - m) - log_sum).float()
        return torch.where(torch.isfinite(m), v, torch.full_like(v, float("nan")))

    xt = x.gather(1, t)
    rank = (x > xt).sum(dim=-1) + 1
    top_ids = _top_n_ids(x, n)
    return lp(t)[:, 0], rank, top_ids, lp(top_ids)


def _check_top_n(logits: torch.Tensor, n: int) -> None:
    if not 0 <= n <= logits.shape[1]:
        raise ValueError(f"n must be in [0, {logits.shape[1]}], got {n}")


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, n: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logprob_rows_torch``'s four tensors, natively for float32 or bf16 CPU rows
    (three read-only passes a row; no [rows, vocab] tensor of logprobs)."""
    _check_per_row(logits, tokens, "tokens")
    _check_top_n(logits, n)  # before the [rows, n] outputs are allocated
    ext = _native_for_rows(logits, bf16=True)
    if ext is None:
        return logprob_rows_torch(logits, tokens, n)
    if not _reads_rows(logits):
        logits = logits.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    rows = logits.shape[0]
    out = (torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64),
           torch.empty(rows, n, dtype=torch.int64), torch.empty(rows, n, dtype=torch.float32))
    ext.logprob_rows(*logprob_rows_args(logits, tokens, n, *out))
    return out


def logprob_rows_args(logits: torch.Tensor, tokens: torch.Tensor, n: int, token_lp: torch.Tensor,
                      rank: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor) -> tuple:
    """What ``_C.logprob_rows`` (and ``kernel_twins.logprob_rows_py``) take."""
    return (logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
            _DTYPE_CODES[logits.dtype], tokens.data_ptr(), n,
            token_lp.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr(),
            torch.get_num_threads())


def _position_seed(seed: int, position: int) -> int:
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    z ^= z >> 31
    return z & _MASK64


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # The float32 logits of a step (from bf16), their penalized copy and their
        # temperature-scaled copy, kept mapped (scratch.py); top-k, top-p and min-p
        # drop tokens in place in the last.
        self._float32 = ScratchTensor()
        self._scaled = ScratchTensor()
        self._penalized = ScratchTensor()

    def release_scratch(self) -> None:
        self._scaled.release()
        self._float32.release()
        self._penalized.release()

    def _widened(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type != "cpu":
            return logits.float()
        return self._float32.take(tuple(logits.shape), torch.float32).copy_(logits)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V], one row per request that samples this step: float32, or the
        model's dtype (bf16), widened to float32 here only where a row needs more
        than the argmax or the temperature's race (widening is exact: the same draws)."""
        V = logits.shape[1]
        if logits.dtype != torch.float32 and not all(
                _draws_from_the_model_logits(r, V) for r in rows):
            logits = self._widened(logits)
        raw = logits
        logits = self._apply_bitmasks(logits, rows)
        logits = self._apply_token_controls(logits, rows)
        logits = self._apply_penalties(logits, rows)
        logits = self._apply_min_tokens(logits, rows)
        random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_idx) == len(rows):  # no greedy row: no argmax pass, no copies
            tokens = self._sample_random(logits, rows)
        else:
            tokens = logits.argmax(dim=-1)
            if random_idx:
                idx = torch.tensor(random_idx, dtype=torch.long)
                sampled = self._sample_random(logits.index_select(0, idx),
                                              [rows[i] for i in random_idx])
                tokens.index_copy_(0, idx, sampled)
        token_list = tokens.tolist()
        logprobs: list[tuple[list[int], list[float], int] | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if want:
            self._logprobs(raw, tokens, rows, want, logprobs)
        return SamplerOutput(token_list, logprobs)

    # -- logits processing ---------------------------------------------------------------
    @staticmethod
    def _apply_bitmasks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        which = [i for i, r in enumerate(rows) if r.allowed_bitmask is not None]
        if not which:
            return logits
        import numpy as np

        words = torch.from_numpy(np.stack([rows[i].allowed_bitmask for i in which]))
        bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        V = logits.shape[1]
        allowed = bits.reshape(len(which), -1)[:, :V].bool()
        logits = logits.clone()
        idx = torch.tensor(which, dtype=torch.long)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits

    @staticmethod
    def _apply_token_controls(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """allowed_token_ids, bad words and logit_bias (vLLM's order). A bad word's
        last token is banned when the output ends with the word's other tokens."""
        which = [i for i, r in enumerate(rows)
                 if r.params.allowed_token_ids is not None or r.params.logit_bias
                 or r.params.bad_words_token_ids]
        if not which:
            return logits
        logits = logits.clone()
        V = logits.shape[1]
        for i in which:
            p, row = rows[i].params, logits[i]
            if p.allowed_token_ids is not None:
                keep = torch.zeros(V, dtype=torch.bool)
                keep[torch.tensor([t for t in p.allowed_token_ids if t < V],
                                  dtype=torch.long)] = True
                row.masked_fill_(~keep, float("-inf"))
            if p.bad_words_token_ids:
                past = rows[i].output_ids
                for word in p.bad_words_token_ids:
                    k = len(word) - 1
                    if k > len(past) or word[-1] >= V:
                        continue
                    if k == 0 or past[-k:] == word[:k]:
                        row[word[-1]] = float("-inf")
            if p.logit_bias:
                ids = [t for t in p.logit_bias if t < V]
                row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition (on prompt + output: a seen logit > 0 divided, else multiplied),
        then frequency (times the output count) and presence (output seen) subtracted,
        as vLLM applies them. Only the seen tokens' logits are read and written, for all
        rows at once: over the whole [rows, vocab] block (or a row at a time) it took
        ~0.5 ms a row of a 49k vocabulary."""
        which = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not which:
            return logits
        V = logits.shape[1]
        # A copy (the caller's logits stay as they are) in memory kept between steps.
        logits = self._penalized.take(tuple(logits.shape), logits.dtype,
                                      logits.device).copy_(logits)
        rep = [i for i in which if rows[i].params.repetition_penalty != 1.0]
        if rep:
            k, r, t, _ = self._seen(rep, [rows[i].prompt_ids + rows[i].output_ids for i in rep],
                                    V)
            rp = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                              dtype=logits.dtype)[k]
            vals = logits[r, t]
            logits[r, t] = torch.where(vals > 0, vals / rp, vals * rp)
        counted = [i for i in which if rows[i].output_ids
                   and (rows[i].params.presence_penalty or rows[i].params.frequency_penalty)]
        if counted:
            k, r, t, n = self._seen(counted, [rows[i].output_ids for i in counted], V)
            fp = torch.tensor([rows[i].params.frequency_penalty for i in counted],
                              dtype=logits.dtype)[k]
            pp = torch.tensor([rows[i].params.presence_penalty for i in counted],
                              dtype=logits.dtype)[k]
            counts = n.to(logits.dtype)
            logits[r, t] = logits[r, t] - fp * counts - pp * (counts > 0)
        return logits

    @staticmethod
    def _seen(row_ids: list[int], ids: list[list[int]], vocab: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each distinct (row, token) of ``ids`` (ids[k] the tokens of row row_ids[k])
        once, as tensors: (k, the row, the token, its count in ids[k]). A token out of
        [0, vocab) raises IndexError, as indexing the row with it did."""
        toks = torch.cat([torch.tensor(x, dtype=torch.long) for x in ids])
        if toks.numel() and (int(toks.max()) >= vocab or int(toks.min()) < 0):
            raise IndexError(f"token id out of range for a vocabulary of {vocab}")
        pos = torch.cat([torch.full((len(x),), k, dtype=torch.long) for k, x in enumerate(ids)])
        keys, counts = torch.unique(pos * vocab + toks, return_counts=True)
        k = keys // vocab
        return k, torch.tensor(row_ids, dtype=torch.long)[k], keys % vocab, counts

    def _apply_min_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Before min_tokens, EOS (unless ignored) and stop tokens cannot be sampled."""
        cloned = False
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_ids) >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids)
            if r.eos_token_id is not None and not p.ignore_eos:
                banned.append(r.eos_token_id)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                if not cloned:
                    logits, cloned = logits.clone(), True
                logits[i, banned] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # SamplingParams takes any finite temperature: one past float32's range would be
        # inf here (refused by the race; x / inf: a dropped token's -inf turns NaN). At
        # float32's largest the row is as flat as at a larger one.
        temps = torch.tensor([min(r.params.temperature, _FLOAT32_MAX) for r in rows],
                             dtype=torch.float32)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        # The race's key per row: (seed, position) for a seeded row (the same draw
        # whatever the batch, and after a preemption), the default generator's otherwise.
        keys = torch.randint(-(1 << 63), (1 << 63) - 1, (len(rows),), dtype=torch.int64)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                keys[i] = _position_seed(r.params.seed, r.position)
        V = logits.shape[1]
        cut = any(0 < k < V for k in top_k) or any(p < 1.0 for p in top_p)
        floor = any(m > 0 for m in min_p)
        if not (cut or floor):  # the kernel divides by the temperature as it reads the row
            return sample_rows(logits, keys, temps)
        temps = temps.to(logits.dtype)
        if logits.device.type == "cpu":
            scaled = self._scaled.take(tuple(logits.shape), logits.dtype)
            logits = torch.div(logits, temps[:, None], out=scaled)
        else:
            logits = logits / temps[:, None]
        if cut:
            logits = self._top_k_top_p(logits, top_k, top_p)
        if floor:
            probs = logits.softmax(dim=-1)
            mp = torch.tensor(min_p, dtype=probs.dtype)
            keep = probs >= probs.max(dim=-1, keepdim=True).values * mp[:, None]
            logits.masked_fill_(~keep, float("-inf"))
        return sample_rows(logits, keys)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Drop (-inf, in place) what top-k then top-p leave out, as vLLM does: top-k keeps the
        values >= the k-th largest (by ``topk``, not a sort of the vocabulary: 32 x 49k
        sorted in ~60 ms here); top-p (``top_p_rows``) keeps, in (logit desc, index
        asc) order, the tokens whose more likely ones weigh < p, on the rows that set it."""
        V = logits.shape[1]
        ks = [kk if 0 < kk < V else V for kk in top_k]
        if any(k < V for k in ks):
            kmax = max(k for k in ks if k < V)
            largest = logits.topk(kmax, dim=-1).values  # descending, ties kept
            kth = largest.gather(1, torch.tensor([min(k, kmax) - 1 for k in ks])[:, None])
            kth = kth.masked_fill(torch.tensor([k >= V for k in ks])[:, None], float("-inf"))
            logits.masked_fill_(logits < kth, float("-inf"))
        rows = [i for i, p in enumerate(top_p) if p < 1.0]
        if not rows:
            return logits
        p = torch.tensor([top_p[i] for i in rows], dtype=torch.float64)
        if len(rows) == len(top_p):
            return top_p_rows_(logits, p)
        idx = torch.tensor(rows, dtype=torch.long)
        return logits.index_copy_(0, idx, top_p_rows_(logits.index_select(0, idx), p))

    # -- logprobs ------------------------------------------------------------------------
    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, targets: list[int], n: int
                        ) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """Logprobs of ``targets`` (the next prompt token of each row of ``logits``)
        and the top-``n`` of each row: (token id rows, logprob rows, ranks)."""
        tgt = torch.tensor(targets, dtype=torch.long)
        tgt_lp, ranks, top_ids, top_lp = logprob_rows(logits, tgt, max(n, 0))
        ids = [[t, *row] for t, row in zip(targets, top_ids.tolist())]
        vals = [[v, *row] for v, row in zip(tgt_lp.tolist(), top_lp.tolist())]
        return ids, vals, ranks.tolist()

    @staticmethod
    def _logprobs(raw, tokens, rows, want, out) -> None:
        idx = torch.tensor(want, dtype=torch.long)
        sampled = tokens.index_select(0, idx)
        picked = raw if len(want) == raw.shape[0] else raw.index_select(0, idx)
        max_n = max(rows[i].params.logprobs for i in want)
        sampled_lp, ranks, top_ids, top_lp = logprob_rows(picked, sampled, max(max_n, 0))
        sampled_l, lp_l, rank_l = sampled.tolist(), sampled_lp.tolist(), ranks.tolist()
        ids_l, vals_l = top_ids.tolist(), top_lp.tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            out[i] = ([sampled_l[j]] + ids_l[j][:n], [lp_l[j]] + vals_l[j][:n], rank_l[j])
