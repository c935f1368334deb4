"""EngineCore's KV-connector hooks (vLLM's EngineCore connector code, in one place).

At start-up: the executor aggregates finished transfers across its workers
(``init_kv_output_aggregator``) and the scheduler-side connector gets every worker's
handshake metadata, merged by (pp_rank, tp_rank). Per request: a request that carries
``kv_transfer_params`` on an engine without a connector is warned about and runs
without transfer (vLLM's behaviour); ``abort_immediately`` aborts it right after adding
so that the connector's ``request_finished`` frees what it reserved.
"""

from __future__ import annotations

import logging
from typing import Any

from enginecore.request import Request

logger = logging.getLogger(__name__)


def init_kv_connector(engine: Any) -> None:
    connector = engine.scheduler.get_kv_connector()
    if connector is None:
        return
    engine.model_executor.init_kv_output_aggregator(connector)
    content: dict[tuple[int, int], Any] = {}
    for worker_dict in engine.model_executor.get_kv_connector_handshake_metadata() or ():
        if worker_dict:
            content.update(worker_dict)
    if content:
        connector.set_xfer_handshake_metadata_pp_aware(content)


def check_kv_transfer_params(engine: Any, request: Request) -> None:
    if request.kv_transfer_params is not None and engine.scheduler.get_kv_connector() is None:
        logger.warning("request %s has kv_transfer_params, but no KV connector is configured; "
                       "it runs without KV transfer", request.request_id)
        request.kv_transfer_params = None


def after_add(engine: Any, request: Request) -> None:
    if request.abort_immediately:
        engine.abort_requests([request.request_id])
