"""One rank of a real gloo job of two that ends without closing its stream loader.

Rank 0 takes one batch and leaves (its epoch gives up at the next step); rank 1 reads its
epoch to the agreed end a few seconds later and exits with the loader still open (a
module-level loader, a script that never calls ``close()``). Both must exit with status 0:
the loader's exit hook closes its agreement (the last steps, its gloo group, its thread)
before the interpreter tears down; a group left to finalization took the process down with
``terminate called without an active exception`` (SIGABRT).

Run by ``tests/test_distributed_lockstep.py`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` and ``PYTHONPATH`` holding ``tests/``::

    python tests/scripts/dist_exit.py
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch.distributed as dist
from datasets import Stream

from aioloader import DataLoader

LATER_S = 3.0  # how much later rank 1 reads on than rank 0 leaves

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
loader = DataLoader(Stream(400 if rank == 0 else 8), batch_size=2)
it = iter(loader)
print(f"rank {rank} head {next(it).tolist()}", flush=True)
if rank == 0:
    dist.destroy_process_group()
    print("rank 0 leaves", flush=True)
    sys.exit(0)
time.sleep(LATER_S)
print(f"rank 1 rest {[b.tolist() for b in it]}", flush=True)
print("rank 1 leaves, its loader open", flush=True)
