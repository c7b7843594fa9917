"""``--manual-gc``: Python's garbage collector under the training loop's control (Megatron-LM's flag)."""
from __future__ import annotations

import gc


class ManualGC:
    """``--manual-gc``: Python's automatic garbage collection off for the loop, collections between iterations.

    A collection can take tens of milliseconds with a model's worth of Python objects, and the
    automatic collector starts one whenever allocations cross a threshold: inside a random
    micro-batch on a random rank, which then straggles for reasons no latency model sees. Off,
    the collector runs only where the loop asks (every ``interval`` iterations, on every rank at
    the same point). The previous state is restored on exit. A scope entered where collection
    is already off does nothing: the profiler nests one per timed point inside one per pass, and
    a full collection per point would cost it a large share of its time.
    """

    def __init__(self, enabled: bool, interval: int):
        self.enabled, self.interval = enabled, interval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "ManualGC":
        if self.enabled and self._was_enabled:
            gc.collect()
            gc.disable()
        return self

    def between_iterations(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()
