"""Where a ``num_workers=0`` batch is made: the one owner of that choice, a pure policy.

::

    asked by                                  answer (Route)       made by
    Epoch.next_inline (``for``, no loop)  ─▶  CALLER  ──────────▶  the caller's thread
                                              THREAD  ──────────▶  the epoch moves to the loop
    ThreadRunner.start_make (the scheduler)   LOOP    ──────────▶  right there, on the loop
    Producer parks / Epoch._next_on_loop  ─▶  LOOP    ──────────▶  the consumer, in __anext__
                                              THREAD  ──────────▶  the helper thread (the
                                                                   scheduler goes on)
         ▲
         └── InlineMaker times every batch, on every route, and tells RoutePolicy.record

Handing a batch to the helper thread and back costs about 60 us of CPU across the two threads,
more than making a batch of a few hundred small samples (torch's ``num_workers=0`` makes them in
the caller's thread, and was twice as fast here). So a batch that is cheap is made where it is
asked for, and a costly one on the helper thread, which makes it while the consumer works (the
loop never stalls for longer than :data:`INLINE_ABOVE_S`, and slow batches keep their
prefetch). Only the thread route collates into memory reused from batch to batch (``_reuse``,
and the batch maker's pre-stacking into it): batches made where asked are cheap, and small.

- :class:`RoutePolicy` answers "which route for the next batch" from the times it was told:
  a pure state machine (no thread, no loop, no clock of its own), tested directly.
- :func:`skips_thread`: the settings under which a loader's batches may skip the thread at
  all (a sync map-style dataset, one helper thread, no deadline: a batch made where it is asked
  for cannot be abandoned at a deadline). An async dataset's items are fetched on the loop and
  decoded off it, whatever they cost.
- :func:`epoch_makes`: the settings under which an epoch makes its batches itself (the caller's
  thread; the consumer on the loop), with no task per batch: no retries (they need the task),
  no device stage (its copies are started by the epoch's hand-over).
"""

from __future__ import annotations

from .._config import LoaderConfig
from .._types import Route

__all__ = [
    "INLINE_ABOVE_S",
    "INLINE_AFTER",
    "INLINE_BACKOFF_BITS",
    "INLINE_BACKOFF_STALLS",
    "INLINE_BELOW_S",
    "RoutePolicy",
    "epoch_makes",
    "skips_thread",
]

# Batches made in under this many seconds are cheaper to make where they are asked for than to
# hand to the thread and back (the hand-over costs ~60 us). Higher: more batches made inline
# (the loop stalls up to this long per batch); lower: more batches pay the hand-over.
INLINE_BELOW_S = 100e-6
# How many batches in a row must be that cheap before the event loop makes them itself.
INLINE_AFTER = 4
# A batch made inline that takes longer than this sends the next ones back to the thread.
INLINE_ABOVE_S = 1e-3
# Each batch that stalled the event loop so makes the run of cheap batches needed before the
# loop makes them again 2**INLINE_BACKOFF_BITS times longer, for the first INLINE_BACKOFF_STALLS
# stalls (4, 64, 1024, then 16384 batches): a dataset with a slow sample now and then (a cache
# miss, a lazy open) stalls the loop a few times in the loader's life, not once per slow one.
INLINE_BACKOFF_BITS = 4
INLINE_BACKOFF_STALLS = 3


def skips_thread(config: LoaderConfig) -> bool:
    """Whether a loader's cheap batches may be made without the helper thread (see the module
    docstring): its runner then has a :class:`RoutePolicy`."""
    return (
        config.kind == "map"
        and config.num_workers == 0
        and not config.thread_pool
        and config.timeout is None
    )


def epoch_makes(config: LoaderConfig, *, device: bool) -> bool:
    """Whether an epoch of a loader that :func:`skips_thread` makes its cheap batches itself,
    in the caller's thread (``for``) or by the consumer on the loop (``device``: the loader has
    a device stage)."""
    return skips_thread(config) and config.max_retries == 0 and not device


class RoutePolicy:
    """Which route the next batch takes, from the time the last ones took (module docstring).

    The event loop makes a batch (:attr:`Route.LOOP`) once the last :attr:`needed` batches each
    took under ``cheap_below_s``, until one takes over ``costly_above_s``. The caller's thread
    (``for``) makes it (:attr:`Route.CALLER`) unless the last batch took over
    ``costly_above_s``: it stalls no loop, so it needs no run of cheap ones first. Each batch
    made on the loop that took that long (:attr:`loop_stalls`) makes :attr:`needed`
    2**:data:`INLINE_BACKOFF_BITS` times longer (for the first :data:`INLINE_BACKOFF_STALLS`).

    Args:
        cheap_below_s: a batch this fast is cheap (default :data:`INLINE_BELOW_S`).
        costly_above_s: a batch this slow is costly (default :data:`INLINE_ABOVE_S`).
        cheap_run: cheap batches in a row before the loop makes them (default
            :data:`INLINE_AFTER`).
    """

    def __init__(
        self,
        *,
        cheap_below_s: float | None = None,
        costly_above_s: float | None = None,
        cheap_run: int | None = None,
    ) -> None:
        self.cheap_below_s = INLINE_BELOW_S if cheap_below_s is None else cheap_below_s
        self.costly_above_s = INLINE_ABOVE_S if costly_above_s is None else costly_above_s
        self.cheap_run = INLINE_AFTER if cheap_run is None else cheap_run
        self._cheap = False  # the last `needed` batches were cheap, none costly since
        self._costly = False  # the last batch was costly
        self._run = 0  # cheap batches in a row so far
        self.loop_stalls = 0  # batches made on the loop that were costly
        self.needed = self.cheap_run  # cheap batches in a row before the loop makes them

    def route(self, *, on_loop: bool) -> Route:
        """The route of the next batch asked for on the event loop (``on_loop``: the
        scheduler, the consumer), or in the caller's own thread (``for``)."""
        if on_loop:
            return Route.LOOP if self._cheap else Route.THREAD
        return Route.THREAD if self._costly else Route.CALLER

    def record(self, seconds: float, route: Route) -> None:
        """A batch took ``seconds`` to make, by ``route``."""
        if seconds > self.costly_above_s:
            if route is Route.LOOP and self._cheap:
                self.loop_stalls += 1
                shift = INLINE_BACKOFF_BITS * min(self.loop_stalls, INLINE_BACKOFF_STALLS)
                self.needed = self.cheap_run << shift
            self._run = 0
            self._cheap = False
            self._costly = True
            return
        self._costly = False
        if seconds < self.cheap_below_s:
            self._run += 1
            if self._run >= self.needed:
                self._cheap = True
        else:
            self._run = 0
