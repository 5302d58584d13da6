"""One epoch: the producer that schedules and makes batches, the reorder buffer where it
meets the consumer, and the consumer that hands batches over.

::

    plan (_plan: the batch sampler's (batch_id, indices), read lazily; resumed ones left out)
        │
    scheduler task ── permit (prefetch) ──▶ produce task per batch               (_produce)
        │ async data: Fetcher.fetch, io_concurrency at once, a served-time clock  (_fetch)
        │ the runner makes the batch under its deadline, with retries              (_deadline)
        │ skipped samples counted against max_failures                             (_failures)
        ▼
    ReorderBuffer.put_nowait(Outcome)                                               (_reorder)
        │ pop_ready, in sampler order or as completed
        ▼
    Epoch.__anext__ ── device copy (optional) ──▶ the batch; the permit goes back  (_consume)
        │
    EpochBook: what was taken, the state that resumes it                            (_resume)

Who produces and who consumes at each arrow is drawn in ``_produce`` and ``_consume``; the
pure state machines (``_reorder``, ``_failures``, ``_resume``, ``_plan``) do no IO and are
tested without a loop. This module only re-exports.
"""

from __future__ import annotations

from ._consume import Epoch as Epoch
from ._consume import EpochIterator as EpochIterator
from ._plan import plan_for as plan_for
from ._produce import nbytes_of as nbytes_of
from ._resume import EpochBook as EpochBook
from ._resume import deal_carried as deal_carried
from ._resume import merge_states as merge_states
