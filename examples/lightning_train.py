"""Train with PyTorch Lightning on an aioloader DataLoader, and resume a stopped run exactly.

    python examples/lightning_train.py                        # 2 epochs, 2 worker processes
    python examples/lightning_train.py --stop-after 11        # stop mid-epoch 1 (a crash)
    python examples/lightning_train.py --resume               # go on from that checkpoint

Lightning takes the loader as it is (any iterable with ``len()``). It saves the loader's
``state_dict()`` in its checkpoints and restores it with ``load_state_dict()``, so the resumed
run trains on exactly the batches the stopped one had not reached, with the same random
augmentation: worker processes reseed before each batch from (seed, epoch, batch). The run
prints the sample indices of the batches it trained on; a stopped run's and its resumed run's
together are the uninterrupted run's. Needs ``pip install lightning``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch

import aioloader

CHECKPOINT = os.path.join("checkpoints", "aioloader-lightning.ckpt")


class Noisy:
    """A map-style data set: 64 samples of 8 features, with noise drawn per sample from torch's
    global generator (a random augmentation, reproducible in worker processes)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor | int]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"x": x + 0.1 * torch.randn(8), "y": x.sum(), "index": i}


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        print(f"step {self.global_step:2d}: samples {batch['index'].tolist()}")
        prediction = self.layer(batch["x"]).squeeze(-1)
        return torch.nn.functional.mse_loss(prediction, batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StopAfter(L.Callback):
    """Saves a checkpoint after ``steps`` steps, then stops the run as a crash would."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.steps:
            trainer.save_checkpoint(CHECKPOINT)
            raise SystemExit(f"stopped after {self.steps} steps; saved {CHECKPOINT}")


def main(args: argparse.Namespace) -> None:
    # The same seed in every run: the stopped run, the resumed one and the loader's checkpoint
    # state must agree on it (load_state_dict refuses another).
    with aioloader.DataLoader(
        Noisy(), batch_size=8, shuffle=True, num_workers=args.workers, seed=0
    ) as loader:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[StopAfter(args.stop_after)] if args.stop_after else [],
        )
        trainer.fit(
            Regression(),
            train_dataloaders=loader,
            ckpt_path=CHECKPOINT if args.resume else None,
            weights_only=True,  # the loader's state is plain data
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=0, help="steps, then stop")
    parser.add_argument("--resume", action="store_true", help=f"resume from {CHECKPOINT}")
    main(parser.parse_args())
