"""``Request``'s stop parameters are read-only views of what its table row holds:
setting one after creation would change nothing the stop check reads (issue 23), so
it is an error, on both paths."""

from __future__ import annotations

import pytest

from enginecore import SamplingParams
from enginecore.request import Request, RequestStatus
from enginecore.sched.request_table import request_table_class

ROW_FIELDS = ("max_tokens", "min_tokens", "stop_token_ids", "ignore_eos")


def stops_after(request: Request, tokens: list[int]) -> tuple[int, RequestStatus]:
    """Append tokens one by one until the row's stop check ends the request."""
    table = request.table
    for n, token in enumerate(tokens, 1):
        table.append_token_ids(request.slot, [token])
        if table.check_stop(request.slot, 1000):
            return n, request.status
    return -1, request.status


def test_row_fields_are_read_only_and_are_what_the_row_stops_on(hot_path):
    table = request_table_class()(None, 4)
    sp = SamplingParams(max_tokens=6, min_tokens=2, stop_token_ids=[7])
    r = Request("r", [1, 2, 3], sp, 9, block_size=4, table=table)
    assert (r.max_tokens, r.min_tokens, r.stop_token_ids, r.ignore_eos) == (6, 2, {7}, False)
    for name in ROW_FIELDS:
        with pytest.raises(AttributeError):
            setattr(r, name, getattr(r, name))
    # A stop id before min_tokens does not stop; after it, it does.
    assert stops_after(r, [7, 5, 7, 5]) == (3, RequestStatus.FINISHED_STOPPED)

    eos = Request("e", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), 9,
                  block_size=4, table=table)
    assert eos.ignore_eos and eos.max_tokens == 4
    assert stops_after(eos, [9, 9, 9, 9, 9]) == (4, RequestStatus.FINISHED_LENGTH_CAPPED)
