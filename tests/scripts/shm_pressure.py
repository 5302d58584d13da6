"""One loader under shared-memory pressure, reporting what it delivered as JSON.

Run by ``tests/test_shm_pressure.py`` inside a private mount namespace whose ``/dev/shm`` is a
64 MiB tmpfs (several copies at once share it, as the ranks of one node do), with
``PYTHONPATH`` holding the repository and ``tests/``::

    python tests/scripts/shm_pressure.py MODE REPORT.json [BARRIER_DIR RANKS]

Modes:

- ``rank``: one of ``RANKS`` ranks' loaders. The first epoch's batches are all held; the
  ranks then wait for each other in ``BARRIER_DIR`` (so all of them hold theirs at once), and
  the second epoch runs while they still are: together the ranks ask for more than
  ``/dev/shm`` has.
- ``fill``: after the second batch another process fills ``/dev/shm`` to the last byte; every
  batch is held, so later batches need new segments that cannot be had.
- ``full``: ``/dev/shm`` is filled before the loader starts, all but 1 MiB (no room for a
  batch).
- ``brim``: ``/dev/shm`` is filled to the last byte before the loader starts. The workers
  start all the same: nothing of theirs lives there.

The report holds, per epoch, the sample indices delivered (in order) and the loader's
``shm_fallbacks``, the messages of the ``aioloader.shm`` warnings logged, and the pre-flight
``RuntimeWarning`` messages. A process that
fails exits non-zero with its traceback on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np

from aioloader import DataLoader

SAMPLES = 96
SAMPLE_INTS = 64 << 10  # 256 KiB a sample: a batch of 8 is 2 MiB, an epoch 24 MiB
BATCH = 8
# A loader's cap on its slots (modes rank and fill): most of the 64 MiB /dev/shm, as if it were
# alone. Four ranks ask for three times what there is; each must then get by inline, never fail.
SHM_MAX_BYTES = 48 << 20
FILLER = "/dev/shm/pressure_filler"

FILL = f"""
import os
fd = os.open({FILLER!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
for chunk in (1 << 20, 4096):  # MiBs, then the last partial MiB a page at a time
    try:
        while os.write(fd, bytes(chunk)) == chunk:
            pass
    except OSError:
        pass
os.close(fd)
"""


class Labeled:
    """Sample ``i`` is 256 KiB of int32, every one ``i``."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> Any:
        return np.full(SAMPLE_INTS, index, dtype=np.int32)


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _indices(batch: Any) -> list[int]:
    rows = np.asarray(batch)
    assert (rows == rows[:, :1]).all(), "a sample holds more than its own index"
    return [int(v) for v in rows[:, 0]]


def fill_dev_shm(leave: int = 0) -> None:
    """Another process takes every byte still free in /dev/shm but ``leave``."""
    subprocess.run([sys.executable, "-c", FILL], check=True, timeout=60)
    if leave:
        os.truncate(FILLER, os.path.getsize(FILLER) - leave)


def barrier(directory: str, ranks: int) -> None:
    """Wait until ``ranks`` processes have called this with ``directory`` (at most 20 s)."""
    open(os.path.join(directory, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 20.0
    while len(os.listdir(directory)) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(directory))} of {ranks} ranks arrived")
        time.sleep(0.02)


def main(mode: str, report_path: str, barrier_dir: str = "", ranks: int = 1) -> None:
    said = _Said()
    logging.getLogger("aioloader.shm").addHandler(said)
    caught = warnings.catch_warnings(record=True)
    shown = caught.__enter__()  # for the whole run: the pre-flight warning is expected here
    warnings.simplefilter("always", RuntimeWarning)
    if mode in ("full", "brim"):
        fill_dev_shm(leave=1 << 20 if mode == "full" else 0)
    epochs: list[dict[str, Any]] = []
    loader = DataLoader(
        Labeled(),
        batch_size=BATCH,
        num_workers=1 if mode == "rank" else 2,  # ranks: many processes on few cores
        collate_fn=np.stack,  # numpy batches: no process of the run needs to import torch
        worker_seeding="worker",  # (seeding torch before every batch would import it)
        prefetch=4,
        timeout=30,
        shm_max_bytes=SHM_MAX_BYTES if mode in ("rank", "fill") else None,
    )
    with loader:
        held: list[Any] = []
        for batch in loader:
            held.append(batch)
            if mode == "fill" and len(held) == 2:
                fill_dev_shm()
        epochs.append(
            {
                "indices": [i for b in held for i in _indices(b)],
                "fallbacks": loader.statistics().shm_fallbacks,
            }
        )
        if mode == "rank":  # a second epoch while every rank holds its first one's batches
            barrier(barrier_dir, ranks)
            second = [i for b in loader for i in _indices(b)]
            epochs.append({"indices": second, "fallbacks": loader.statistics().shm_fallbacks})
        del held
    report = {
        "pid": os.getpid(),
        "epochs": epochs,
        "warnings": said.messages,
        "preflight": [str(w.message) for w in shown if issubclass(w.category, RuntimeWarning)],
    }
    with open(report_path, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2] if len(args) > 2 else "", int(args[3]) if len(args) > 3 else 1)
