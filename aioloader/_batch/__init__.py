"""Making a batch: read the samples, transform them, collate them.

The same code runs wherever the CPU work of a batch runs: a loader thread (``num_workers=0``,
``thread_pool=True``) or a worker process, which gives an ``alloc`` that places each stacked
array straight into a shared-memory slot::

    BatchRequest (batch_id, indices, or items an async dataset fetched)
        │ BatchMaker.make (_make)
        ▼
    dataset[i] / __getitems__ / decode(raw) ── transform ──▶ samples
        │                        large arrays copied into the batch as each sample is read
        │                        (Prestack, _prestack), its memory reused by the next sample
        ▼
    collate_fn (default_collate / numpy_collate: _collate) ── each leaf stacked (_stacking)
        │                        into alloc(shape, dtype): a slot, or memory a thread reuses
        ▼
    Made (the batch, the indices skipped, timings) to the runner that asked

- ``_make``: :class:`BatchMaker` (one batch of a map-style dataset) and :class:`StreamCursor`
  (the next batch of a stream), error notes that name the batch and the index, the skip rule.
- ``_collate``: torch's collation rules, into ``alloc`` where given, with errors naming the
  key path, the positions and the shapes (phrased by ``_mismatch``).
- ``_prestack``: a batch's large arrays stacked as each sample is read.
- ``_stacking``: the copy at the heart of collation, by numpy or torch.
- ``_mismatch``: how samples that cannot form one batch are described.

This package runs in any thread or process and owns no concurrency. This module only
re-exports.
"""

from __future__ import annotations

from ._collate import default_collate as default_collate
from ._collate import default_convert as default_convert
from ._collate import numpy_collate as numpy_collate
from ._make import MAX_OPEN_STREAMS as MAX_OPEN_STREAMS
from ._make import BatchMaker as BatchMaker
from ._make import StreamCursor as StreamCursor
from ._make import annotate as annotate
from ._make import continued_share as continued_share
from ._make import indices_text as indices_text
from ._make import not_an_exit as not_an_exit
from ._make import stop_as_error as stop_as_error
from ._make import stray_cancel as stray_cancel
from ._make import stream_batch as stream_batch
from ._make import users_interrupt as users_interrupt
