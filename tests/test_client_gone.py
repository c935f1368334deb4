"""A client that disconnects mid-request is a 499 for the endpoint, not an engine error
(answer() / first_event() used to turn ClientGone into a 500 "internal error")."""

import asyncio

import pytest

from enginecore.entrypoints.openai.serving_engine import ClientGone, answer, first_event


class _GoneRequest:
    """The ASGI side of a client that has hung up."""

    async def receive(self) -> dict:
        return {"type": "http.disconnect"}


class _StayingRequest:
    """A client that stays connected."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


async def _never() -> None:
    await asyncio.Event().wait()


async def _stream():
    await asyncio.Event().wait()
    yield None


def test_answer_lets_client_gone_through():
    with pytest.raises(ClientGone):
        asyncio.run(answer(_GoneRequest(), _never()))


def test_first_event_lets_client_gone_through_and_closes_the_stream():
    stream = _stream()

    async def run() -> None:
        try:
            await first_event(_GoneRequest(), stream)
        finally:
            assert stream.ag_running is False

    with pytest.raises(ClientGone):
        asyncio.run(run())


def test_other_errors_still_become_the_clients_answer():
    async def boom() -> None:
        raise ValueError("bad temperature")

    from enginecore.entrypoints.openai.errors import APIError

    with pytest.raises(APIError) as info:
        asyncio.run(answer(_StayingRequest(), boom()))
    assert info.value.status == 400
