"""DPEngineCoreActor: one data-parallel rank as a Ray actor (more than one machine).

The front-end knows every address up front and hands the actor its INIT message
directly, so there is no handshake socket: ``wait_for_init`` builds the engine
(every rank at once: the DP group forms then), ``run`` serves until the actor is
killed. Ray is imported only by the front-end; this module works without it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from enginecore.config import EngineConfig
from enginecore.protocol import HandshakeInit

logger = logging.getLogger(__name__)


class DPEngineCoreActor:
    def __init__(self, config: EngineConfig, init: bytes, executor_class: Any,
                 log_stats: bool, engine_index: int, log_level: int = logging.WARNING) -> None:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s "
                            f"engine{engine_index} %(name)s: %(message)s")
        self._config = config
        self._init = msgspec.msgpack.decode(init, type=HandshakeInit)
        self._executor_class = executor_class
        self._log_stats = log_stats
        self.engine_index = engine_index
        self.engine: Any = None

    def wait_for_init(self) -> tuple[int, int]:
        """Build the engine; (num_gpu_blocks, max_model_len) once it is ready."""
        from enginecore.core.engine_process import engine_core_proc_class

        self.engine = engine_core_proc_class(self._config)(
            self._config, None, self._executor_class, self._log_stats,
            self.engine_index, init=self._init)
        return (self._config.cache_config.num_gpu_blocks or 0, self.engine.scheduler.max_model_len)

    def run(self) -> None:
        """The busy loop; returns only if this rank leaves in a rescale."""
        from enginecore.core.engine_core_proc import RankRemoved

        engine = self.engine
        if engine is None:
            raise RuntimeError("call wait_for_init first")
        try:
            engine.run_busy_loop()
        except RankRemoved:
            logger.info("engine %d left the data-parallel group", self.engine_index)
        except BaseException:
            logger.exception("engine %d died", self.engine_index)
            engine.send_engine_dead()
            raise
        finally:
            engine.shutdown()

    def pid(self) -> int:
        return os.getpid()
