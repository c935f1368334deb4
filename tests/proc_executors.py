"""Executors for process tests; module-level so the spawned engine can import them."""

from __future__ import annotations

from enginecore.executor import SyntheticExecutor
from enginecore.executor.synthetic import state_fields


class FailAfterExecutor(SyntheticExecutor):
    """Fails on its 4th model step, as a broken device would."""

    def execute_model(self, so, non_block=False):
        if self.num_steps >= 3:
            self._mark_failed()
            raise RuntimeError("injected executor failure")
        return super().execute_model(so, non_block)


class LogprobsExecutor(SyntheticExecutor):
    """Returns 20 logprobs per token: large output frames (>= 64 KiB per step)."""

    def _run(self, so):
        out = super()._run(so)
        out.logprobs = [
            ([[t] + list(range(20))], [[-0.5] + [-float(i) for i in range(20)]], [1])
            if t_list else None
            for t_list in out.sampled_token_ids for t in (t_list or [0])[:1]
        ]
        return out


# Fault injection (the synthetic instrument with faults; module-level for spawn).
POISON = 31_999  # a prompt holding this token makes every batch it is in raise
LATE_POISON = 31_998  # ... once the request has LATE_AFTER output tokens
LATE_AFTER = 8


class FaultInjectingExecutor(SyntheticExecutor):
    """Raises for a batch that holds a poisoned request, after the runner state was
    updated (as a real runner failing mid-step would leave it). Subclasses add
    faults that are no request's doing."""

    # Every N-th model step fails once for no request's fault (0: never).
    transient_every = 0
    # From this model step on every call raises, dummy batches too (0: never).
    lose_device_after = 0

    def _init_executor(self) -> None:
        super()._init_executor()
        self._poisoned: dict[str, tuple[bool, int]] = {}  # rid -> (late, prompt length)
        self.num_faults = 0

    def _run(self, so):
        out = super()._run(so)
        for new in so.scheduled_new_reqs:
            prompt = new.token_ids[: new.num_prompt_tokens]
            if POISON in prompt or LATE_POISON in prompt:
                self._poisoned[new.req_id] = (LATE_POISON in prompt, new.num_prompt_tokens)
        for rid in so.finished_req_ids:
            self._poisoned.pop(rid, None)
        if self.lose_device_after and self.num_steps >= self.lose_device_after:
            self._fault("the device is gone")
        if self.transient_every and self.num_steps % self.transient_every == 0:
            self._fault("a transient fault")
        for rid in so.num_scheduled_tokens:
            hit = self._poisoned.get(rid)
            if hit is None:
                continue
            late, prompt_len = hit
            if not late or state_fields(self._state[rid])[1] - prompt_len >= LATE_AFTER:
                self._fault(f"poisoned request {rid}")
        return out

    def _fault(self, what: str) -> None:
        self.num_faults += 1
        raise RuntimeError(f"injected fault: {what}")

    def execute_dummy_batch(self) -> None:
        if self.lose_device_after and self.num_steps >= self.lose_device_after:
            raise RuntimeError("injected fault: the device is gone")
        super().execute_dummy_batch()


class TransientFaultExecutor(FaultInjectingExecutor):
    transient_every = 20


class LostDeviceExecutor(FaultInjectingExecutor):
    lose_device_after = 6
