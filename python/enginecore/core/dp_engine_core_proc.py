"""DPEngineCoreProc: one data-parallel rank of an engine set.

Two modes (``ParallelConfig.data_parallel_lockstep``):

* independent (dense models): the rank is an EngineCoreProc that also tells
  the coordinator its request counts when they change;
* lockstep (MoE): every rank steps while any rank has work, in *waves*. A rank
  with nothing to do runs a dummy batch so the model's collectives line up.
  Every ``SYNC_EVERY`` steps the ranks all-reduce (work left, calls waiting
  for agreement): when no rank has work the wave ends on every rank at the
  same step (rank 0 tells the coordinator ``wave_complete``). A rank that gets
  work while idle starts the next wave and asks the coordinator to wake the
  others (``start_wave`` -> ``START_DP_WAVE``).

Calls that must hold on every rank before they return (``pause_scheduler``,
``barrier``, ``reinitialize_distributed``) are agreed in the same all-reduce:
each rank counts the calls it received; a call returns once every rank has
received as many (the minimum over ranks), so staggered calls from several
front-ends pair up in order and never deadlock.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from enginecore.core.dp_group import StatelessDPGroup
from enginecore.core.engine_core_proc import EngineCoreProc, RankRemoved
from enginecore.protocol import (
    EngineCoreOutputs,
    HandshakeInit,
    SchedulerStats,
    StartDPWave,
    UtilityOutput,
    UtilityRequest,
)

logger = logging.getLogger(__name__)

# All-reduce cadence: the wave-end check costs one collective per this many steps.
SYNC_EVERY = 32
# Utility calls that return only once every rank has received them.
AGREED_CALLS = ("pause_scheduler", "barrier", "reinitialize_distributed")
# Outputs addressed to this client index go to the coordinator.
COORDINATOR = -1


class DPEngineCoreProc(EngineCoreProc):
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        pc = config.parallel_config
        self.dp_rank = pc.data_parallel_rank
        self.dp_size = pc.data_parallel_size
        self.lockstep = pc.data_parallel_lockstep
        self.prefill_interval = config.scheduler_config.prefill_schedule_interval
        self.step_counter = 0
        self.current_wave = 0
        self.engines_running = False
        self.has_coordinator = False
        self.dp_group: StatelessDPGroup | None = None
        self._store_address: str | None = None
        self._last_counts: tuple[int, int] | None = None
        # Agreed calls: received so far, completed so far, and the replies owed.
        self._received = dict.fromkeys(AGREED_CALLS, 0)
        self._completed = dict.fromkeys(AGREED_CALLS, 0)
        self._owed: dict[str, list[tuple[UtilityRequest, UtilityOutput]]] = {
            m: [] for m in AGREED_CALLS}
        self._rescale_to: tuple[int, int] | None = None
        self._removed = False
        self.num_dummy_batches = 0
        # Wave steps at which new requests were admitted (the latest 256).
        self.admission_steps: deque[int] = deque(maxlen=256)
        super().__init__(config, *args, **kwargs)

    # -- start-up ----------------------------------------------------------------------
    def _init_data_parallel(self, init: HandshakeInit) -> None:
        self.has_coordinator = init.coordinator_output_address is not None
        if self.lockstep:
            if not init.dp_store_address:
                raise RuntimeError("lockstep data parallel needs the front-end's DP store address")
            self._store_address = init.dp_store_address
            self.dp_group = StatelessDPGroup(init.dp_store_address, self.dp_rank, self.dp_size,
                                             init.dp_group_generation)
            self._join_sync()
        logger.info("DP rank %d of %d (%s), coordinator: %s", self.dp_rank, self.dp_size,
                    "lockstep" if self.lockstep else "independent", self.has_coordinator)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request, request_wave: int = 0) -> None:
        if self.lockstep and request_wave != self.current_wave:
            if request_wave > self.current_wave:
                self.current_wave = request_wave  # the front-end knows of a later wave
            elif not self.engines_running:
                # The request's wave already ended: the next one starts here.
                self._start_wave_here()
        super().add_request(request, request_wave)

    def _handle_start_wave(self, msg: StartDPWave) -> None:
        if not self.lockstep or msg.exclude_engine_index == self.engine_index:
            return
        if msg.wave < self.current_wave:
            logger.debug("rank %d ignores START_DP_WAVE %d (stale; wave %d)", self.dp_rank,
                         msg.wave, self.current_wave)
            return
        self.current_wave = msg.wave
        if not self.engines_running:
            logger.debug("rank %d joins wave %d", self.dp_rank, msg.wave)
            self.engines_running = True

    def _start_wave_here(self) -> None:
        """This rank has work while the engines are idle: run, and have the
        coordinator wake the others."""
        self.engines_running = True
        if self.has_coordinator:
            self._to_coordinator(EngineCoreOutputs(start_wave=self.current_wave))

    def _to_coordinator(self, outs: EngineCoreOutputs) -> None:
        outs.engine_index = self.engine_index
        self.output_queue.put_nowait((COORDINATOR, outs))

    # -- agreed utility calls ----------------------------------------------------------
    def _run_utility(self, call: UtilityRequest) -> None:
        out = self._call_utility(call)
        if call.method not in AGREED_CALLS or out.failure_message is not None:
            self._reply_utility(call, out)
            return
        if not self.lockstep and call.method != "reinitialize_distributed":
            self._reply_utility(call, out)  # independent ranks: nothing to agree on
            return
        self._received[call.method] += 1
        self._owed[call.method].append((call, out))
        if not self.lockstep:
            self._agree({call.method: self._received[call.method]})

    def _outstanding(self) -> bool:
        return any(self._owed[m] for m in AGREED_CALLS)

    def _agree(self, agreed: dict[str, int]) -> bool:
        """Every rank has received ``agreed[m]`` calls of m: reply to those.
        True when the group was rescaled."""
        for method, count in agreed.items():
            owed = self._owed[method]
            while owed and self._completed[method] < count:
                call, out = owed.pop(0)
                self._completed[method] += 1
                if method == "reinitialize_distributed":
                    # The counts start over in the new group (new ranks start at 0);
                    # what is left is agreed there.
                    self._rescale()
                    self._reply_utility(call, out)
                    return True
                self._reply_utility(call, out)
        return False

    def resume_scheduler(self) -> None:
        if self._owed["pause_scheduler"]:
            raise RuntimeError(
                f"a pause is still in flight on DP rank {self.dp_rank} (waiting for every rank "
                "to pause); call resume_scheduler after pause_scheduler has returned")
        super().resume_scheduler()

    def reinitialize_distributed(self, new_size: int, generation: int) -> bool:
        if new_size < 1:
            raise ValueError(f"new data-parallel size must be >= 1, got {new_size}")
        self._rescale_to = (new_size, generation)
        return self.dp_rank < new_size

    def _rescale(self) -> None:
        """Every rank agreed: leave the old group, join the new one (or exit)."""
        assert self._rescale_to is not None
        new_size, generation = self._rescale_to
        old = self.dp_size
        if self.dp_group is not None:
            self.dp_group.destroy()
            self.dp_group = None
        if self.dp_rank >= new_size:
            logger.info("DP rank %d leaves (size %d -> %d)", self.dp_rank, old, new_size)
            self._removed = True
            return
        self.dp_size = new_size
        self.config.parallel_config.data_parallel_size = new_size
        for m in AGREED_CALLS:  # a new group counts agreed calls from zero
            self._received[m] = len(self._owed[m])
            self._completed[m] = 0
        if self.lockstep:
            assert self._store_address is not None
            self.dp_group = StatelessDPGroup(self._store_address, self.dp_rank, new_size,
                                             generation)
            self._join_sync()
        logger.info("DP rank %d: size %d -> %d (generation %d)", self.dp_rank, old, new_size,
                    generation)

    # -- busy loop ---------------------------------------------------------------------------
    def _idle(self) -> bool:
        if self._removed:
            return False  # leave the loop: this rank is done
        if not self.lockstep:
            return not self._has_work()
        return not (self._has_work() or self.engines_running or self._outstanding())

    def run_busy_loop(self) -> None:
        while not self._removed:
            self._process_input_queue()
            if self._removed:
                break
            if self.lockstep:
                self._lockstep_step()
            else:
                self._process_engine_step()
            self._publish_request_counts()
        raise RankRemoved()

    def _lockstep_step(self) -> None:
        if not self.engines_running:
            self._start_wave_here()
        # Prefill throttling: new requests are admitted on cadence steps only.
        scheduler = self.scheduler
        scheduler.admit_new_prefills = self.step_counter % self.prefill_interval == 0
        admitted = scheduler.num_admitted
        executed = self._process_engine_step()
        if scheduler.num_admitted != admitted:
            self.admission_steps.append(self.step_counter)
        if not executed and not self.model_executor.is_sleeping:
            # Nothing of ours ran: a dummy batch keeps the collectives in step.
            self.execute_dummy_batch()
            self.num_dummy_batches += 1
        self.step_counter += 1
        if self.step_counter % SYNC_EVERY == 0:
            self._sync()

    def _sync(self) -> None:
        """The every-SYNC_EVERY-steps all-reduce: end the wave, agree on calls.
        Every rank gets the same reduced values, so all decide alike."""
        assert self.dp_group is not None
        received = [self._received[m] for m in AGREED_CALLS]
        # One MIN all-reduce; maxima travel negated.
        reduced = self.dp_group.all_reduce_min(
            [-int(self._has_work()), *received, *(-r for r in received)])
        n = len(AGREED_CALLS)
        any_work = -reduced[0]
        fewest, most = reduced[1:1 + n], [-r for r in reduced[1 + n:]]
        if self._agree(dict(zip(AGREED_CALLS, fewest))):
            return  # rescaled: the wave ended with the old group
        if any_work or most != fewest:
            return  # work left somewhere, or a call some rank has not received yet
        self._end_wave()

    def _join_sync(self) -> None:
        """First collective of a (new) group: every rank takes the latest wave and
        runs if any rank is running, from step 0. Ranks that join an engine set
        already serving (elastic scale-up) start in step with it this way."""
        assert self.dp_group is not None
        running = int(self.engines_running or self._has_work() or self._outstanding())
        wave, any_running = self.dp_group.all_reduce_min([-self.current_wave, -running])
        self.current_wave = -wave
        self.engines_running = bool(-any_running)
        self.step_counter = 0

    def _end_wave(self) -> None:
        if self.engines_running and self.dp_rank == 0:
            target = COORDINATOR if self.has_coordinator else 0
            outs = EngineCoreOutputs(wave_complete=self.current_wave)
            outs.engine_index = self.engine_index
            self.output_queue.put_nowait((target, outs))
        logger.debug("rank %d: wave %d complete", self.dp_rank, self.current_wave)
        self.engines_running = False
        self.current_wave += 1
        self.step_counter = 0

    def _publish_request_counts(self) -> None:
        """Running/waiting counts to the coordinator, only when they change."""
        if not self.has_coordinator:
            return
        counts = self.scheduler.get_request_counts()
        if counts != self._last_counts:
            self._last_counts = counts
            self._to_coordinator(EngineCoreOutputs(scheduler_stats=SchedulerStats(
                num_running_reqs=counts[0], num_waiting_reqs=counts[1],
                step_counter=self.step_counter, current_wave=self.current_wave)))

    def get_dp_state(self) -> dict[str, Any]:
        return {
            "data_parallel_rank": self.dp_rank, "data_parallel_size": self.dp_size,
            "lockstep": self.lockstep, "current_wave": self.current_wave,
            "engines_running": self.engines_running, "step_counter": self.step_counter,
            "num_dummy_batches": self.num_dummy_batches,
            "admission_steps": list(self.admission_steps),
            "prefill_schedule_interval": self.prefill_interval,
        }

    def make_stats(self) -> SchedulerStats:
        stats = super().make_stats()
        stats.current_wave = self.current_wave
        return stats
