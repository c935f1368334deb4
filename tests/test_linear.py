"""Pre-packed CPU weights (model/linear.py): the same bits as F.linear on the
plain weight, the plain weight recoverable, and the switch to keep them plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore.model.linear import Linear, packing_enabled

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(packing_enabled(torch.bfloat16, CPU) != "onednn",
                                   reason="no oneDNN packed linear in this torch")


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_gives_f_linear_bits(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    lin = Linear(w, b, pack=True)
    assert lin.weight is None and lin.packed is not None  # the plain copy is not kept
    assert torch.equal(lin(x), F.linear(x, w, b))
    assert torch.equal(lin.dense(), w)


def test_plain_when_switched_off_or_not_bf16(monkeypatch):
    assert not packing_enabled(torch.float32, CPU)
    monkeypatch.setenv("ENGINECORE_PACK_WEIGHTS", "0")
    assert not packing_enabled(torch.bfloat16, CPU)
    w = torch.randn(8, 4)
    lin = Linear(w, pack=False)
    x = torch.randn(3, 4)
    assert torch.equal(lin(x), F.linear(x, w)) and lin.dense() is w
