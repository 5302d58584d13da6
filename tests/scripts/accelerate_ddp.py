"""Two-process accelerate training on CPU over aioloader loaders; ``test_accelerate`` starts
one process per rank with the environment ``torchrun`` would give them.

Usage: ``RANK=r WORLD_SIZE=2 ... python accelerate_ddp.py OUTDIR``

``Accelerator(cpu=True)`` makes the gloo process group. Two cases, one after the other, each
training a fresh model for 2 epochs through ``accelerator.prepare`` and ``backward``:

- ``explicit``: the loader has an :class:`aioloader.DistributedSampler`, made after the
  Accelerator (it reads rank and world size from the process group);
- ``default``: a loader with ``shuffle=True`` and no sampler.

Each rank writes ``OUTDIR/<case>-rank<r>.json``: the batches it trained on, and the trained
weights (the same on every rank when gradients were averaged across them).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from framework_data import Indexed, record

import aioloader

BATCH = 4  # 40 samples, 2 ranks: 5 batches per rank and epoch


def train(accelerator: Accelerator, case: str) -> dict[str, object]:
    dataset = Indexed()
    if case == "explicit":
        sampler = aioloader.DistributedSampler(dataset, shuffle=True, seed=1)
        loader = aioloader.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    else:
        loader = aioloader.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    records = []
    with loader:
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
        for epoch in range(2):
            prepared.set_epoch(epoch)
            for batch in prepared:
                records.append(record(batch))
                loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    weights = accelerator.unwrap_model(model).weight.detach().flatten().tolist()
    return {"records": records, "weights": weights, "world_size": accelerator.num_processes}


def main(outdir: str) -> None:
    accelerator = Accelerator(cpu=True)
    for case in ("explicit", "default"):
        result = train(accelerator, case)
        path = os.path.join(outdir, f"{case}-rank{accelerator.process_index}.json")
        with open(f"{path}.partial", "w") as f:
            json.dump(result, f)
        os.replace(f"{path}.partial", path)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
