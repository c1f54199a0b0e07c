"""``engine.tput_timer``: DeepSpeed's throughput timer, driven by the engine (``forward`` starts a micro-step,
``step`` stops it) and callable by user code (``update_epoch_count()`` at an epoch's end; ``start``/``stop``).

Invariants: nothing is timed until ``start_step`` optimizer steps have been counted (warm-up), so ``start_time``
stays 0 until then; ``stop`` without a ``start`` before it does nothing; ``step_elapsed_time`` sums the micro-steps
of the current optimizer step and is reset when ``stop(global_step=True)`` ends it; ``total_elapsed_time`` sums every
timed micro-step. Durations are host wall-clock time with no device synchronization (the engine's hot path is not
serialized for a timer), so they are meaningful over many steps, not for one.
"""

from __future__ import annotations

import time


class ThroughputTimer:
    """Samples per second over the optimizer steps after the first ``start_step`` (see the module docstring)."""

    def __init__(self, batch_size: int = 1, start_step: int = 2) -> None:
        if batch_size < 1 or start_step < 0:
            raise ValueError(f"ThroughputTimer: batch_size={batch_size} must be >= 1, start_step={start_step} >= 0")
        self.batch_size = batch_size
        self.start_step = start_step
        self.initialized = False
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """Mark the end of an epoch (the micro-step count restarts, as DeepSpeed's does)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro-step; its time is taken once ``start_step`` optimizer steps have passed."""
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step begun by :meth:`start` (no-op without one); ``global_step``: it ends an optimizer
        step. ``report_speed`` is accepted for DeepSpeed's signature (the engine's progress line reports)."""
        del report_speed
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` over the mean time of the timed optimizer steps (``-inf`` before any was timed)."""
        timed = self.global_step_count - self.start_step
        if timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")
