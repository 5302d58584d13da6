"""A tiny LightningModule that records every batch it trains and validates on.

Shared by ``test_lightning`` and the multi-process script ``scripts/lightning_ddp.py``. It
imports Lightning, so datasets for worker processes live in ``framework_data`` instead.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import lightning as L
import torch
from framework_data import Record, record


class Recorder(L.LightningModule):
    """Linear regression on ``x``; keeps a :data:`Record` of each batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.train_records: list[Record] = []
        self.val_records: list[Record] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.train_records.append(record(batch))
        prediction = self.layer(batch["x"]).squeeze(-1)
        return torch.nn.functional.mse_loss(prediction, batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ValRecorder(Recorder):
    """A :class:`Recorder` that validates too (Lightning warns about a ``validation_step``
    without a validation loader, so only this one has it)."""

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_records.append(record(batch))


class Stop(Exception):
    """Raised by :class:`SaveThenStop`: the run ends as a crash would end it."""


class SaveThenStop(L.Callback):
    """Saves a checkpoint once ``steps`` optimizer steps are done, then stops the run."""

    def __init__(self, steps: int, path: str) -> None:
        self.steps = steps
        self.path = path

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(self.path)
            raise Stop(f"stopped after {self.steps} steps")


def trainer(**overrides: Any) -> L.Trainer:
    """A quiet CPU trainer: 2 epochs, no logger, no checkpoints or bars unless asked."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(overrides)
    with warnings.catch_warnings():
        # On a machine with a GPU, Lightning warns that a CPU trainer leaves it unused.
        warnings.filterwarnings("ignore", message="GPU available but not used")
        return L.Trainer(**settings)


def dump(path: str, payload: Any) -> None:
    """Write ``payload`` as JSON, atomically (a reader never sees half a file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(payload, f)
    os.replace(partial, path)
