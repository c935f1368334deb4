"""M-RoPE (Qwen2-VL's multimodal rotary): three position rows per token.

Every token has a (temporal, height, width) position. Text tokens have the same
value in the three rows and advance by one; the tokens of an image (its
``t x h x w`` grid after the spatial merge) share the temporal row and count
rows and columns in the other two, all offset by the position where the image
starts; the text after an image continues from ``start + max(h, w)`` (not from
``start + t*h*w``), so a prompt's largest position is below its length.
``delta = max position + 1 - prompt length``: a token at index ``p`` past the
prompt (every decode token) sits at ``p + delta`` in all three rows. This is
transformers' ``Qwen2VLModel.get_rope_index`` and its ``rope_deltas``.

The rotary itself splits each head's frequencies in three sections
(``mrope_section``, summing to rotary_dim / 2): section i rotates by row i's
position. ``MRotaryStep`` gathers those cos/sin values from the ordinary
one-row tables (the same float32 values transformers computes), then rotates
with ``RotaryStep`` over the gathered per-token rows: native or twin alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from enginecore.model.rope import RotaryStep


def mrope_input_positions(num_tokens: int,
                          items: Sequence[tuple[int, Sequence[int]]],
                          spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Positions [3, num_tokens] (int64) and the delta for tokens past them.

    ``items``: (offset of the first placeholder token, (t, h, w) grid in patches)
    of each image or video in the prompt; each covers ``t*h*w / merge**2`` tokens."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur = 0  # the next text position
    done = 0  # tokens placed so far
    m = spatial_merge_size
    for offset, (t_in, h_in, w_in) in sorted(items, key=lambda it: it[0]):
        t, h, w = int(t_in), int(h_in) // m, int(w_in) // m
        n = t * h * w
        if offset < done or offset + n > num_tokens:
            raise ValueError(f"placeholder at {offset} of {n} tokens overlaps another or runs "
                             f"past the prompt's {num_tokens} tokens")
        text = offset - done
        pos[:, done:offset] = np.arange(cur, cur + text)
        cur += text
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        pos[:, offset:offset + n] = grid.reshape(3, n) + cur
        cur += max(h, w)
        done = offset + n
    pos[:, done:] = np.arange(cur, cur + num_tokens - done)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


def positions_with_delta(start: int, end: int, delta: int) -> np.ndarray:
    """[3, end - start] positions of tokens past the prompt (decode, or outputs
    recomputed after a preemption)."""
    return np.broadcast_to(np.arange(start + delta, end + delta, dtype=np.int64),
                           (3, end - start))


def mrope_chunk_positions(prompt_positions: np.ndarray, delta: int, start: int,
                          end: int) -> np.ndarray:
    """[3, end - start] positions of tokens start..end of a request whose prompt
    has ``prompt_positions`` (a prefill chunk, a decode token, or both sides of
    the prompt's end after a preemption)."""
    L = prompt_positions.shape[1]
    if end <= L:
        return prompt_positions[:, start:end]
    if start >= L:
        return positions_with_delta(start, end, delta)
    return np.concatenate([prompt_positions[:, start:], positions_with_delta(L, end, delta)],
                          axis=1)


def mrope_column_rows(mrope_section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """For each of the rotary_dim cos/sin columns, the position row (0 temporal, 1
    height, 2 width) it rotates by: the sections over the first half, repeated."""
    if sum(mrope_section) * 2 != rotary_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to half the rotary "
                         f"dimension {rotary_dim}")
    half = torch.cat([torch.full((s,), i % 3, dtype=torch.long)
                      for i, s in enumerate(mrope_section)])
    return torch.cat([half, half])


class MRotaryStep:
    """RoPE for one step's [3, T] positions; callable like ``RotaryStep``."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 positions: torch.Tensor, column_rows: torch.Tensor) -> None:
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [3, tokens], got {tuple(positions.shape)}")
        # [T, rotary_dim]: column j of token i from the table row positions[rows[j], i].
        idx = positions.index_select(0, column_rows).t()
        cols = torch.arange(cos_table.shape[1], device=cos_table.device)
        cos = cos_table[idx, cols].contiguous()
        sin = sin_table[idx, cols].contiguous()
        T = positions.shape[1]
        self._step = RotaryStep(cos, sin, torch.arange(T, device=positions.device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._step(x)
