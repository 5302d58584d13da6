"""Statistics: what the loader counts while it runs, and how it is shown.

::

    pipeline (event-loop thread) ── bumps ──▶ Counters (_counters)
                                                  │ DataLoader.statistics()
                                                  ▼
                                      LoaderStatistics (a frozen snapshot, the verdict)
                                                  │ progress=
                                                  ▼
                                      EpochProgress: one tqdm bar per epoch (_progress)

- ``_cpu``: the CPU time of the process tree and the CPUs it may use, read from ``/proc``.
- ``_counters``: :class:`Counters` (mutable, bumped on the loop thread only), the frozen
  :class:`LoaderStatistics` and :class:`EpochStatistics` snapshots, and the bottleneck verdict.
- ``_progress``: ``progress=``, a bar per epoch fed from snapshots (the ``progress`` extra).

This module only re-exports; ``_progress`` reads ``_counters``, which reads ``_cpu``, never the
other way.
"""

from __future__ import annotations

from ._counters import VERDICT_WARNING_MIN_S as VERDICT_WARNING_MIN_S
from ._counters import WAIT_SHARE_THRESHOLD as WAIT_SHARE_THRESHOLD
from ._counters import Capacity as Capacity
from ._counters import Counters as Counters
from ._counters import EpochStatistics as EpochStatistics
from ._counters import LoaderStatistics as LoaderStatistics
from ._counters import WorkerFigures as WorkerFigures
from ._counters import cpus_available as cpus_available
from ._counters import current_counters as current_counters
from ._progress import EpochProgress as EpochProgress
from ._progress import progress_display as progress_display
