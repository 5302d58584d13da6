"""Epoch bookkeeping: which epoch comes next, what of it was taken, and the state that resumes it.

:class:`EpochBook` is a small synchronous state machine the loader asks at the start of every
epoch (:meth:`EpochBook.begin`), tells about every batch taken (:meth:`EpochBook.took`) and at
the end (:meth:`EpochBook.finished`); :meth:`EpochBook.state_dict` describes where it is and
:meth:`EpochBook.load` makes the next epoch continue from such a state. The base seed is the
loader's business (it may have to restart its workers to adopt a saved one); the book only
carries it in the state.

Who calls ``set_epoch`` on a sampler (the rule the DataLoader docstring states):

- samplers the loader made (``shuffle``, the default sequential order): the loader, before
  every epoch, with the epoch's number;
- a sampler or batch sampler the user passed: only for an epoch the user named with
  ``loader.set_epoch(n)``, and when resuming a state saved in such an epoch. A user's own
  ``sampler.set_epoch(e)`` before iterating (torch's ``DistributedSampler`` idiom) is thus
  never replaced by the loader's count, which may differ from the user's.

Resume is exact when the sampler is deterministic given its state: the sampler's
``state_dict()`` is taken after ``set_epoch`` and before ``iter()``, so it describes the whole
epoch (aioloader's samplers draw the epoch's order at ``iter()``; a ``RandomSampler`` with a
``generator`` saves the generator's state). A user's sampler without ``state_dict`` is resumed
through ``set_epoch`` where the loader drove it, and otherwise as the user's loop sets it.

A stateful async stream (``aioloader.sources.TarDataset``, or any async iterable dataset with
``state_dict``/``load_state_dict``) is resumed through its own state: the book keeps the state
the stream had after the last batch taken (the producer takes one per batch it pulls, so
batches in flight are read again, not lost), saves it as ``"stream"``, and loads it into the
dataset when the resumed epoch begins. Other streams restart.
"""

from __future__ import annotations

from typing import Any

from ._config import Sampling
from ._types import AsyncIterableDataset, Stateful
from ._validate import check_state_keys, non_negative_int

__all__ = ["EpochBook"]


class EpochBook:
    """The epochs of one loader, for ``set_epoch``, ``state_dict`` and ``load_state_dict``.

    Args:
        sampling: the loader's samplers (whose ``set_epoch`` and state it drives).
    """

    def __init__(self, sampling: Sampling, dataset: object = None) -> None:
        self._sampling = sampling
        # An async stream that saves its own position (see the module docstring), or None.
        stream = isinstance(dataset, AsyncIterableDataset) and isinstance(dataset, Stateful)
        self._stream = dataset if stream else None
        # The stream's state after every batch of this epoch up to a gap was taken; batches
        # taken past a gap (in_order=False) keep theirs until the gap closes, so a resumed
        # epoch repeats them rather than losing the ones in the gap.
        self._stream_state: dict[str, Any] | None = None
        self._stream_later: dict[int, dict[str, Any] | None] = {}  # taken past the gap
        self._stream_next = 0  # the first batch id of this epoch not taken
        self.next_epoch = 0
        self._asked: int | None = None  # loader.set_epoch(n), not yet used by an epoch
        self._drives = False  # the current epoch's set_epoch went to a user's sampler
        self._resume: dict[str, Any] | None = None
        self._done: list[int] = []  # batch ids of the current epoch taken by the consumer
        self._sampler_state: dict[str, Any] | None = None  # before the current epoch's iter()
        self._epoch = 0
        self.open = False  # an epoch started and not run to its end

    def replace_sampling(self, sampling: Sampling) -> None:
        """Use ``sampling`` from the next epoch on (a rank's share decided late); a sampler the
        loader made is told the epoch asked for, as :meth:`set_epoch` tells it."""
        self._sampling = sampling
        set_epoch = getattr(sampling.batches, "set_epoch", None)
        if callable(set_epoch) and sampling.built:
            set_epoch(self.next_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch ``epoch``; a user's sampler is told too, at its start.

        A sampler the loader made is told at once as well, so that the batch sampler iterated
        on its own yields that epoch's batches (accelerate's ``skip_first_batches`` wraps it in
        a torch DataLoader); an epoch already running read its order at its start and keeps
        it. A user's sampler is told once, at the epoch's start, by the rule above.
        """
        self._asked = self.next_epoch = non_negative_int("epoch", epoch)
        set_epoch = getattr(self._sampling.batches, "set_epoch", None)
        if callable(set_epoch) and self._sampling.built:
            set_epoch(epoch)

    def begin(self) -> tuple[int, set[int]]:
        """Start the next epoch: returns its number and the batch ids already taken (resume).

        Loads a resumed sampler state, then calls ``set_epoch`` where the rule says so, then
        records the sampler's state: the caller calls ``iter()`` on the batch sampler next.
        """
        resume, self._resume = self._resume, None
        if resume is not None:
            epoch = int(resume["epoch"])
            done = {int(i) for i in resume["done"]}
            drive = bool(resume.get("set_epoch", False))
        else:
            epoch, done, drive = self.next_epoch, set(), self._asked is not None
        self._asked = None
        self._epoch = epoch
        self.next_epoch = epoch + 1
        self._done = sorted(done)
        self._stream_state = resume.get("stream") if resume is not None else None
        self._stream_later, self._stream_next = {}, 0
        if self._stream_state is not None and isinstance(self._stream, Stateful):
            self._stream.load_state_dict(self._stream_state)
        self._drives = drive and not self._sampling.built
        batches = self._sampling.batches
        if batches is not None:
            if resume is not None and resume.get("sampler") is not None:
                if not isinstance(batches, Stateful):
                    raise ValueError(
                        f"the state holds a sampler state but batch_sampler={batches!r} has "
                        "no load_state_dict"
                    )
                batches.load_state_dict(resume["sampler"])
            set_epoch = getattr(batches, "set_epoch", None)
            if callable(set_epoch) and (self._sampling.built or drive):
                set_epoch(epoch)
            self._sampler_state = _state_of(batches)
        self.open = True
        return epoch, done

    def took(self, batch_id: int, stream_state: dict[str, Any] | None = None) -> None:
        """The consumer took (or was given the error of) batch ``batch_id``; a stateful
        stream stood at ``stream_state`` after it."""
        self._done.append(batch_id)
        if self._stream is None:
            return
        self._stream_later[batch_id] = stream_state
        while self._stream_next in self._stream_later:
            state = self._stream_later.pop(self._stream_next)
            self._stream_state = state if state is not None else self._stream_state
            self._stream_next += 1

    def finished(self) -> None:
        """The current epoch ran to its end: a state now points at the next one."""
        self.open = False
        self._done = []
        self._stream_state = None

    def state_dict(self, seed: int) -> dict[str, Any]:
        """Where the epochs are (see :meth:`aioloader.DataLoader.state_dict`)."""
        if self.open:
            return {
                "epoch": self._epoch,
                "done": list(self._done),
                "sampler": self._sampler_state,
                "set_epoch": self._drives,
                "seed": seed,
                "stream": self._stream_state,
            }
        return {
            "epoch": self.next_epoch,
            "done": [],
            "sampler": _state_of(self._sampling.batches),
            "set_epoch": self._asked is not None and not self._sampling.built,
            "seed": seed,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Make the next epoch continue from ``state`` (its seed was checked by the caller)."""
        state = check_state_keys("DataLoader", state, ("epoch", "done", "seed"))
        non_negative_int("state 'epoch'", state["epoch"])
        self._resume = dict(state)


def _state_of(batches: object) -> dict[str, Any] | None:
    return batches.state_dict() if isinstance(batches, Stateful) else None
