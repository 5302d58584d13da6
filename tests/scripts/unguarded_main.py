"""A training script as torch users write them on Linux: no ``if __name__ == "__main__":``
guard, the dataset, a namedtuple, the collate_fn (a lambda) and worker_init_fn all defined
here, a loader with two worker processes iterated at the top level and never closed.

Run by ``test_worker_compat``: it must print the top-level line once (workers never run this
file), print the batches, and exit cleanly. An optional argument names the start method.
"""

import collections
import os
import sys
from typing import Any

import aioloader

print(f"top level ran in {os.getpid()}", flush=True)

Pair = collections.namedtuple("Pair", "index square")
OFFSET = 100  # a global the dataset reads: it travels with the class, by value


def note_worker(worker_id: int) -> None:
    os.environ["SCRIPT_WORKER"] = str(worker_id)


class Squares:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        assert os.environ["SCRIPT_WORKER"] in ("0", "1"), "worker_init_fn did not run"
        return Pair(i, i * i + OFFSET)


method = sys.argv[1] if len(sys.argv) > 1 else None
loader = aioloader.DataLoader(
    Squares(),
    batch_size=4,
    num_workers=2,
    collate_fn=lambda samples: list(samples),  # a lambda: by value too
    worker_init_fn=note_worker,
    mp_context=method,
)
for epoch in range(2):
    batches = list(loader)
    # A batch of this file's namedtuple comes back as that very class (pickled by name).
    assert all(type(pair) is Pair for batch in batches for pair in batch), batches
    print(f"epoch {epoch}: {[[p.square for p in batch] for batch in batches]}", flush=True)
print("done", flush=True)
