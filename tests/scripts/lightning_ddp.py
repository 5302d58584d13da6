"""Lightning DDP on CPU over aioloader loaders; ``test_lightning`` runs it in a child process.

Usage: ``python lightning_ddp.py {ddp,ddp_spawn} OUTDIR``

Fits of 2 processes each (gloo), one after the other, one per case:

- ``passed``: a loader made before ``fit()`` (before any process group) and passed to it. With
  ``ddp`` every process makes its own (Lightning re-runs this script for rank 1); with
  ``ddp_spawn`` Lightning pickles it into the processes it spawns;
- ``hook``: the loader is made in ``train_dataloader()``, once Lightning has made the process
  group, with ``shuffle=True`` and no sampler: it reads its rank's share by itself;
- ``sampler`` (``ddp`` only): the same with an explicit :class:`aioloader.DistributedSampler`
  (which reads rank and world size from the group).

Each rank writes ``OUTDIR/<case>-rank<r>.json`` (the batches it trained on) when its training
ends; a fit that raises here writes ``OUTDIR/<case>-error.txt`` and the script goes on.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from framework_data import Indexed
from lightning_model import Recorder, dump, trainer

import aioloader

BATCH = 4  # 40 samples, 2 ranks: 5 batches per rank and epoch


class RankRecorder(Recorder):
    """Writes what this rank trained on when training ends, then closes the loader it used."""

    def __init__(self, case: str, outdir: str) -> None:
        super().__init__()
        self.case = case
        self.outdir = outdir

    def on_train_end(self) -> None:
        path = os.path.join(self.outdir, f"{self.case}-rank{self.global_rank}.json")
        dump(path, {"records": self.train_records, "world_size": self.trainer.world_size})
        loader = self.trainer.train_dataloader
        if isinstance(loader, aioloader.DataLoader):
            loader.close()  # in a spawned process, this is the unpickled copy


class HookRecorder(RankRecorder):
    """Makes its loader in ``train_dataloader()``, when the process group exists."""

    def train_dataloader(self) -> Any:
        dataset = Indexed()
        if self.case == "sampler":
            sampler = aioloader.DistributedSampler(dataset, shuffle=True, seed=1)
            return aioloader.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        return aioloader.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=1)


# "passed" first: its loader must be built before any fit has made a process group.
CASES = {"ddp": ("passed", "hook", "sampler"), "ddp_spawn": ("passed", "hook")}


def main(strategy: str, outdir: str) -> None:
    for case in CASES[strategy]:
        loader = None
        try:
            if case == "passed":
                model: RankRecorder = RankRecorder(case, outdir)
                loader = aioloader.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=1)
            else:
                model = HookRecorder(case, outdir)
            trainer(devices=2, strategy=strategy).fit(model, train_dataloaders=loader)
        except Exception:
            with open(os.path.join(outdir, f"{case}-error.txt"), "w") as f:
                f.write(traceback.format_exc())
        finally:
            if loader is not None:
                loader.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
