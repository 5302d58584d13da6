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

Streams (iterable datasets) have no sampler: a mid-epoch state records, for a
:class:`~aioloader._types.ResumableStream`, where each reader's copy of the dataset stood
(``"streams"``), and the resumed epoch continues each reader from there. A reader is a worker
process or the helper thread for a sync stream, and the loader's event loop for an async one
(``aioloader.sources.TarDataset``): one reader whatever ``num_workers`` is, so an async
stream resumes under another number of workers. Per reader the book keeps the state after
the last of its batches taken with every earlier one of its batches: batches taken past one
still in flight (``in_order=False``) keep theirs until it is taken, so a resumed epoch
repeats them rather than losing the one in flight. A stream without that protocol cannot
continue: :meth:`EpochBook.load` refuses a state that says batches of it were taken, rather
than replay the epoch from its start (those batches would be trained on twice, silently). A
state saved between epochs needs nothing of the stream and is always accepted.

On another number of ranks (elastic resume): a mid-epoch state of a loader whose samples are
shared out by aioloader's ``DistributedSampler`` in plain batches also records ``"consumed"``,
the positions of the epoch's order every rank has read (ranges; under DDP every rank took the
same batch ids, so rank 0's state says it for all). Loaded where only the world size and what
follows from it differ (``num_replicas``, ``len(sampler)``, ``len(loader)``), the state is
rebased (:meth:`EpochBook.check`): no batch taken yet, the sampler holding those positions, so
that its ``iter()`` shares out the rest of the order over the new ranks. The next epochs are
those of an uninterrupted run on the new ranks. A state saved in such a rest holds the
positions in its sampler state; the layout it is checked against is the samplers' with that
state loaded (into a copy), so it resumes on as many ranks by batch ids, and on
others again.

A state is a rank's own where the ranks' differ (:meth:`EpochBook._own_rank`): batch ids taken
out of order (``in_order=False``) and a rollover carry. It records ``"rank"``, holds no
``"consumed"``, and resumes that rank only, on as many ranks; :func:`merge_states` refuses it.
A loader built before the process group has no rank yet: such a state loaded then is checked
when the loader takes its share (:meth:`EpochBook.replace_sampling`), or, if no group came, at
the first epoch. The refusal gives the way on from that state alone (replay its epoch).

A stream read in units (``TarDataset``, ``ParquetDataset``) resumes on another number of ranks
(and workers) from every rank's state merged into one (:func:`merge_states`, exported as
``aioloader.distributed.merge_states``): each rank's dataset state says which records that rank
consumed (:mod:`aioloader.sources`' ``merge_stream_states`` replays it), and the merged state
holds them all, no batch taken yet; each new rank's dataset deals the rest of the epoch out
again. Any other stream resumes on the same ranks only. What a rank carries into its next
epoch under equal steps (``"equal_steps"``, beside the book's state) is that rank's own: a
merged state holds every rank's (:func:`merge_states` logs how many, at INFO), and each loader
that loads it takes its part (:func:`deal_carried`).

The skip budget (``on_error='skip'`` with ``max_failures``) is of the epoch, interrupted or
not: a mid-epoch state records what it counted in the batches taken (``"failures"``: samples
seen, indices skipped, and the rank that counted them), and the resumed epoch's budget starts
from there (:class:`~aioloader._types.SkipsTaken`), so it is crossed at the batch an
uninterrupted epoch crosses it. The budget is a rank's own: a loader of another rank (rank 0's
state resuming every rank under DDP), a state rebased onto other ranks and a merged stream
state start it at zero, and so does a state saved before the field was recorded (as before).

The format is versioned (``"version"``, :data:`STATE_VERSION`) and checked whole where it is
loaded, never later at the first batch. A mid-epoch state counts the batches taken by id, and an
id means the same samples only under the same settings: every state records them
(``"layout"``: shuffle, the samplers, batch size, last batch, lengths, world size) and a
mid-epoch one is refused by a loader whose settings differ, naming each setting and both
values (a state between epochs goes into any loader whose samplers read its sampler state:
nothing of it was taken). The sampler state is never loaded into the user's samplers for a
check that may fail (a state_dict() loaded back does not undo a load for many samplers): a
carry outside the dataset is refused from the state's data, and only the rest of an elastic
epoch is tried, in a copy (the datasets shared); once accepted it is loaded once (a load that
raises refuses the state, naming the sampler; ``len(loader)`` counts the epoch it resumes),
and a later state loaded before the epoch starts gives them back their own first (one
replaces the other whole). A state saved by the previous release for a stateless batch
sampler (torch's) around a stateful sampler holds no sampler state (that release saved none
there): it resumes as then where the order is still known (the loader drove the epoch, or the
sampler's own epoch is the state's: ``sampler.set_epoch(n)`` before the load), and is refused
mid-epoch where it is not (another epoch, or a generator's order past epoch 0). Settings
recorded later in format 1 (``"replacement"``) are compared only where the saved layout has
them, so a state saved before loads as it did. Every
field is checked for its type and range (``done`` holds distinct batch ids of the epoch; the seed of
the shuffle the loader made is the state's ``seed``). States without a version (format 0,
before the layout was recorded) migrate explicitly (:func:`_migrated`) when saved between
epochs; one saved mid-epoch is refused, with the two ways on: replay the epoch, or vouch for
the loader by adding its layout.
"""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._config import Sampling
from .._log import distributed_log
from .._sampling import DistributedSampler, RandomSampler, consumed_positions
from .._types import (
    ResumableStream,
    SkipsTaken,
    Stateful,
    StreamPosition,
    StreamResume,
    check_readers,
)
from .._validate import (
    boolean,
    check_state_keys,
    is_int,
    non_negative_int,
    positive_int,
    to_int,
    value_errors,
)
from ..sources import merge_stream_states
from ._chain import (
    GLOBAL_RANDOM,
    LAYOUT,
    check_unsaved_order,
    epoch_setter,
    first_int,
    generator_states,
    index_state,
    keys_within,
    last_batch,
    layout_in_copy,
    layout_of,
    length,
    load_accepted,
    matching_generators,
    nested,
    sampler_keys,
    samplers,
    set_generators,
    state_holder,
    state_of,
)

__all__ = ["STATE_VERSION", "EpochBook", "deal_carried", "merge_states"]

#: The format :meth:`EpochBook.state_dict` writes. 0: no ``"version"`` key (a mid-epoch state
#: recorded at most the batch size and dataset length, as ``"shape"``); 1: ``"version"`` and
#: the ``"layout"`` of every setting that decides which samples a batch id is. A mid-epoch state
#: of format 1 may hold ``"failures"`` (the skip budget so far); one without it is of the same
#: format, saved before it was recorded, and starts the budget at zero.
STATE_VERSION = 1

# Settings recorded since a later release of format 1: compared only where the saved layout
# has them (a state saved before says nothing of them, and is loaded as it was).
_ADDED = frozenset({"replacement"})


class EpochBook:
    """The epochs of one loader, for ``set_epoch``, ``state_dict`` and ``load_state_dict``.

    Args:
        sampling: the loader's samplers (whose ``set_epoch`` and state it drives).
        dataset: the loader's dataset (a stream's resume needs it to be a
            :class:`~aioloader._types.ResumableStream`).
        in_order: whether the loader yields its batches in sampler order; out of order, the
            batch ids a rank took are its own (see :meth:`_own_rank`).
    """

    def __init__(
        self,
        sampling: Sampling,
        dataset: Any = None,
        draw_seed: Callable[[], object] | None = None,
        *,
        in_order: bool = True,
    ) -> None:
        self._sampling = sampling
        self._dataset = dataset
        self._in_order = in_order
        # Draws a base seed from the loader's ``generator`` (when the loader's seed was drawn
        # from it): torch draws one for every iterator, before its sampler draws from the same
        # generator. The loader's construction drew the first epoch's; each later epoch draws
        # its own when the previous one ends (so a state saved between epochs is after it), or
        # as it begins if the previous one was left early.
        self._draw_seed = draw_seed
        self._begun = False
        self._drawn = False
        # The current epoch's stream readers (see the module docstring): reader -> state after
        # its last batch taken with all its earlier ones; positions taken past a batch of the
        # reader still in flight, by (reader, seq); each reader's first seq not taken.
        self._positions: dict[int, Any] = {}
        self._held: dict[tuple[int, int], Any] = {}
        self._next_seq: dict[int, int] = {}
        self._readers: int | None = None  # how many readers the positions are of
        self._last_reader = -1  # the reader of the last position kept
        self.stream_resume: StreamResume | None = None  # how the current epoch's stream began
        self._skips = SkipsTaken()  # the current epoch's skip count of the batches taken
        self.next_epoch = 0
        self._asked: int | None = None  # loader.set_epoch(n), not yet used by an epoch
        self._drives = False  # the current epoch's set_epoch went to a user's sampler
        self._resume: dict[str, Any] | None = None
        # The samplers' own state before a pending state's sampler state was loaded into
        # them (see load): given back where a later state replaces it.
        self._before: dict[str, Any] | None = None
        self._done: list[int] = []  # batch ids of the current epoch taken by the consumer
        self._sampler_state: dict[str, Any] | None = None  # before the current epoch's iter()
        self._layout: dict[str, Any] | None = None  # the current epoch's, likewise
        self._generators: list[Any] | None = None  # of samplers without a state, likewise
        self._warned_unresumable = False
        self._epoch = 0
        #: ``len(loader)`` of a stream, as last asked (None: never asked); more batches than
        #: that in an epoch are warned of once, as torch does (see :meth:`took`).
        self.stream_len: int | None = None
        self._warned_len = False
        self._alone = True  # the current epoch is the only one under way
        self.open = False  # an epoch started and not run to its end

    def replace_sampling(self, sampling: Sampling) -> None:
        """Use ``sampling`` from the next epoch on (a rank's share decided late); a sampler the
        loader made is told the epoch asked for, as :meth:`set_epoch` tells it.

        A state loaded before (checked against the samplers replaced) is checked again
        against these: its batch ids may be other samples in a rank's share.

        Raises:
            ValueError: the pending state does not fit the new samplers (it is dropped: the
                next epoch is a whole one, as after any refusal).
        """
        pending = self._resume
        self._drop_pending()  # the samplers replaced, as they were
        self._sampling = sampling
        set_epoch = epoch_setter(sampling.batches)
        if set_epoch is not None and sampling.built:
            set_epoch(self.next_epoch)
            self._took_sampler_epoch()
        if pending is None:
            return
        try:
            self.load(pending)
        except ValueError as exc:
            raise ValueError(
                "the state loaded into this loader before torch.distributed's process group "
                "existed was checked against the whole dataset's samplers; now that the group "
                f"exists the loader reads rank {self._rank()}'s share, and the state does not "
                f"fit it: {exc} (the state is dropped: load it after init_process_group, or "
                "call len(loader) once the group exists and then load it)"
            ) from exc

    @property
    def pending(self) -> bool:
        """A state is loaded and its epoch not begun."""
        return self._resume is not None

    def _drop_pending(self) -> None:
        """Drop the pending state, giving the samplers back their own state from before it."""
        holder = state_holder(self._sampling.batches)
        if holder is not None and self._before is not None:
            holder.load_state_dict(self._before)
        self._resume = self._before = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch ``epoch``; a user's sampler is told too, at its start.

        A sampler the loader made is told at once as well, so that the batch sampler iterated
        on its own yields that epoch's batches (accelerate's ``skip_first_batches`` wraps it in
        a torch DataLoader); an epoch already running read its order at its start and keeps
        it. A user's sampler is told once, at the epoch's start, by the rule above.
        """
        self._asked = self.next_epoch = non_negative_int("epoch", epoch)
        set_epoch = epoch_setter(self._sampling.batches)
        if set_epoch is not None and self._sampling.built:
            set_epoch(epoch)
            self._took_sampler_epoch()

    def _took_sampler_epoch(self) -> int | None:
        """The epoch the user gave the sampler the loader made (``loader.sampler.set_epoch(e)``,
        torch's idiom) since the book last told it one, if any; forgotten once read."""
        sampler = self._sampling.sampler
        asked = getattr(sampler, "set_epoch_asked", None)
        if asked is not None:
            sampler.set_epoch_asked = None
        return asked if self._sampling.built and isinstance(asked, int) else None

    def begin(self, alone: bool = True) -> tuple[int, set[int]]:
        """Start the next epoch: returns its number and the batch ids already taken (resume).
        ``alone``: no other iterator's epoch is under way (its batches would be counted here).

        Loads a resumed sampler state, then calls ``set_epoch`` where the rule says so, then
        records the sampler's state: the caller calls ``iter()`` on the batch sampler next.
        """
        resume = self._resume  # cleared once its sampler state is loaded (it was checked)
        if resume is not None and self._rank() is None:  # no group came: checked now
            try:
                self._check_rank(resume)
            except ValueError as exc:  # dropped whole: the next iter() runs a whole epoch
                self._drop_pending()
                raise ValueError(f"{exc} (the state is dropped, its seed too)") from exc
        if resume is not None:
            epoch = int(resume["epoch"])
            done = {int(i) for i in resume["done"]}
            drive = bool(resume.get("set_epoch", False))
        else:
            epoch, done, drive = self.next_epoch, set(), self._asked is not None
            told = self._took_sampler_epoch()
            if told is not None and self._asked is None:
                epoch = told  # loader.sampler.set_epoch(e): as loader.set_epoch(e)
        batches = self._sampling.batches
        if batches is not None and resume is not None:
            if resume.get("sampler") is not None:
                holder = state_holder(batches)
                if holder is None:
                    raise ValueError(
                        f"the state holds a sampler state but batch_sampler={batches!r} "
                        "holds no sampler with load_state_dict"
                    )
                holder.load_state_dict(resume["sampler"])
            if resume.get("generators") is not None:
                set_generators(batches, resume["generators"])
        self._resume = self._before = None
        self._asked = None
        if resume is None and self._begun and not self._drawn and self._draw_seed is not None:
            self._draw_seed()  # the previous epoch was left early (a resumed one's is saved)
        self._begun, self._drawn = True, False
        self._alone, self._warned_len = alone, False
        self._epoch = epoch
        self.next_epoch = epoch + 1
        self._done = sorted(done)
        self._begin_stream(resume, done)
        self._drives = drive and not self._sampling.built
        if batches is not None:
            set_epoch = epoch_setter(batches)
            if set_epoch is not None and (self._sampling.built or drive):
                set_epoch(epoch)
                self._took_sampler_epoch()  # the book's own, forgotten
            self._sampler_state = state_of(batches)
            self._generators = generator_states(batches)
        # Before iter(): a rollover carry read ahead at the epoch's end changes len(batches).
        self._layout = self.layout()
        self.open = True
        return epoch, done

    def _begin_stream(self, resume: dict[str, Any] | None, done: set[int]) -> None:
        saved = resume.get("streams") if resume is not None else None
        self._positions, self._held, self._next_seq = {}, {}, {}
        self._readers, self._last_reader = None, -1
        if saved is not None:
            self._positions = {int(k): v for k, v in saved["states"].items()}
            self._readers, self._last_reader = int(saved["readers"]), int(saved["last"])
        self._skips = self._resumed_skips(resume) if done else SkipsTaken()
        self.stream_resume = StreamResume(
            first_id=max(done) + 1 if done else 0,
            streams=self._readers,
            last=self._last_reader,
            states=dict(self._positions),
            skips=self._skips,  # the epoch's budget starts from it and adds to it
        )

    def _resumed_skips(self, resume: dict[str, Any] | None) -> SkipsTaken:
        """The skip count a resumed epoch's budget starts from: the state's, where this
        loader's rank counted it (see the module docstring); else none."""
        saved = resume.get("failures") if resume is not None else None
        if not isinstance(saved, dict) or saved["rank"] != self._rank():
            return SkipsTaken()
        return SkipsTaken(seen=int(saved["seen"]), skipped=list(saved["skipped"]))

    def _rank(self) -> int | None:
        """This loader's rank, as its samplers say (None: not sharded by rank, or a stream)."""
        return first_int(samplers(self._sampling.batches), "rank")

    def took(self, batch_id: int, position: StreamPosition | None = None) -> None:
        """The consumer took (or was given the error of) batch ``batch_id``; ``position`` is
        where its stream's reader stood after it (resumable streams)."""
        self._done.append(batch_id)
        if position is not None:
            reader, seq = position.stream, position.seq
            self._readers = position.streams
            self._held[reader, seq] = position.state
            nxt = self._next_seq.get(reader, 0)
            while (reader, nxt) in self._held:
                self._positions[reader] = self._held.pop((reader, nxt))
                self._last_reader = reader
                nxt += 1
            self._next_seq[reader] = nxt
        # Last, so that a warning turned into an error leaves the position kept.
        if self.stream_len is not None and len(self._done) > self.stream_len and self._alone:
            self._warn_len()

    def _warn_len(self) -> None:
        if self._warned_len:
            return
        self._warned_len = True
        warnings.warn(  # the epoch in the text: Python's default filter shows a text once
            f"epoch {self._epoch}: len(loader) said {self.stream_len} batches, from the "
            f"IterableDataset's __len__ ({type(self._dataset).__name__}), but the epoch has "
            f"yielded {len(self._done)} so far: its __len__ undercounts, or, in a stream that "
            "shards itself by get_worker_info(), workers yield more than their shares",
            UserWarning,
            stacklevel=2,
        )

    def finished(self) -> None:
        """The current epoch ran to its end: a state now points at the next one."""
        self.open = False
        self._done = []
        if self._draw_seed is not None and not self._drawn:
            self._draw_seed()  # the next epoch's, as torch's next iterator would
            self._drawn = True
        self._positions, self._held, self._next_seq = {}, {}, {}
        self._readers, self._last_reader = None, -1
        self._skips = SkipsTaken()

    def state_dict(self, seed: int) -> dict[str, Any]:
        """Where the epochs are (see :meth:`aioloader.DataLoader.state_dict`). A state loaded
        and not yet begun is where they are: saving again before the first resumed batch (a
        second preemption, a framework's checkpoint right after its restore) keeps it."""
        if self._resume is not None:
            return {**self._resume, "seed": seed}
        if self.open:
            streams = None
            if self._readers is not None:
                streams = {
                    "readers": self._readers,
                    "last": self._last_reader,
                    "states": dict(self._positions),
                }
            if self._done:
                self._warn_unresumable()
            state = {
                "version": STATE_VERSION,
                "epoch": self._epoch,
                "done": list(self._done),
                "sampler": self._sampler_state,
                "generators": self._generators,
                "set_epoch": self._drives,
                "seed": seed,
                "streams": streams,
                "layout": self._layout,  # what "done" counts in (see check)
                "failures": {  # the skip budget's count of the batches in "done"
                    "rank": self._rank(),
                    "seen": self._skips.seen,
                    "skipped": list(self._skips.skipped),
                },
            }
            own = self._own_rank(self._sampler_state, bool(self._done))
            if own is not None:
                state["rank"] = own  # its batch ids, or its carry, are this rank's alone
            else:
                consumed = self._consumed()
                if consumed is not None:
                    state["consumed"] = consumed  # for a resume on another number of ranks
            return state
        told = getattr(self._sampling.sampler, "set_epoch_asked", None)  # not taken yet
        built = self._sampling.built and self._asked is None and isinstance(told, int)
        sampler_state = state_of(self._sampling.batches)
        state = {
            "version": STATE_VERSION,
            "epoch": told if built else self.next_epoch,
            "done": [],
            "sampler": sampler_state,
            "generators": generator_states(self._sampling.batches),
            "set_epoch": self._asked is not None and not self._sampling.built,
            "seed": seed,
            "layout": self.layout(),
        }
        own = self._own_rank(sampler_state, False)
        if own is not None:
            state["rank"] = own
        return state

    def _own_rank(self, sampler_state: object, taken: bool) -> int | None:
        """This loader's rank where a state of it resumes this rank only (None: every rank).

        Under DDP rank 0's state resumes every rank because every rank takes the same batch
        ids, each of its own share, in the same order, and nothing else of the state is a
        rank's. Two things are a rank's own: the batch ids taken out of order
        (``in_order=False``: each rank's come as its own batches complete), and a rollover
        carry (each rank's tail of its share). Such a state records ``"rank"``; a loader of
        another rank, or of another number of ranks, refuses it (:meth:`_check_rank`).
        """
        chain = samplers(self._sampling.batches)
        replicas, rank = first_int(chain, "num_replicas"), first_int(chain, "rank")
        if replicas is None or replicas < 2 or rank is None:
            return None
        carry = nested(sampler_state, "carry")
        if (taken and not self._in_order) or (isinstance(carry, list | tuple) and carry):
            return rank
        return None

    def _consumed(self) -> list[list[int]] | None:
        """The positions of the epoch's order every rank read, where the epoch is shared out
        by a DistributedSampler of ours in plain batches (see :func:`_elastic`): None where
        the state cannot say (another sampler, a rollover, a sharded batch sampler, batches
        taken out of order on several ranks)."""
        sampler: object = self._sampling.sampler
        batches = self._sampling.batches
        inner = index_state(self._sampler_state)
        size = getattr(batches, "batch_size", None)
        plain = getattr(batches, "sampler", None) is sampler
        plain = plain and last_batch([batches]) in ("keep", "discard")
        if not isinstance(sampler, DistributedSampler) or inner is None or not is_int(size):
            return None
        if not plain:
            return None
        return consumed_positions(sampler, inner, self._done, int(size))

    def layout(self) -> dict[str, Any]:
        """The settings that decide which samples each batch id of an epoch is, as a state
        records them (see :data:`LAYOUT`); None where unknown or not applicable (a stream has
        no sampler, a dataset or sampler may have no length)."""
        return layout_of(self._sampling.batches, self._sampling.sampler, self._dataset)

    def _warn_unresumable(self) -> None:
        """Warn (once) if a sampler the user passed draws its order from torch's global
        generator: no state restores that, so a resumed epoch would repeat and miss samples."""
        if self._warned_unresumable:
            return
        for sampler in samplers(self._sampling.batches):
            name = type(sampler).__name__
            stateless = not isinstance(sampler, Stateful)  # (aioloader's save their seed)
            if stateless and name in GLOBAL_RANDOM and getattr(sampler, "generator", 0) is None:
                self._warned_unresumable = True
                warnings.warn(
                    f"state_dict(): {name} without a generator draws each epoch's order from "
                    "torch's global generator when the epoch starts, which no state restores: "
                    "resuming this state mid-epoch repeats some samples and misses others. "
                    f"Give it one ({name}(..., generator=torch.Generator().manual_seed(s)); "
                    "its state is saved), or use the loader's shuffle=True with seed=",
                    UserWarning,
                    stacklevel=4,  # the caller of loader.state_dict()
                )
                return

    def load(self, state: dict[str, Any], *, check: bool = True) -> None:
        """Make the next epoch continue from ``state`` (its seed was checked by the caller).

        Args:
            state: a :meth:`state_dict`.
            check: check it first (see :meth:`check`); ``False`` for a state the caller
                checked, and for the book's own, carried by a pickled loader (which restarts a
                stream that cannot continue, as before).

        Raises:
            ValueError: a key is missing, a field has the wrong type or is out of range (each
                named with its value), the format is newer or (mid-epoch) older than this
                one's, a mid-epoch state was saved under other settings (each named with both
                values), the sampler state is not for these samplers, or the state says
                batches of a stream were taken and the dataset is not a
                :class:`~aioloader._types.ResumableStream` (or the state holds no reader
                positions).
        """
        resume = dict(self.check(state) if check else state)
        batches = self._sampling.batches
        holder = state_holder(batches)
        self._drop_pending()  # a later state replaces a pending one whole
        if holder is not None and resume.get("sampler") is not None:
            # Now, as the epoch's start will again: len(loader) counts the batches of the
            # epoch it resumes (a rollover carry, the rest of an epoch on other ranks).
            before = load_accepted(holder, _copied(resume["sampler"]), _chain_text(batches))
            self._before = before
        self._resume = resume

    def check(
        self,
        state: dict[str, Any],
        *,
        readers: int | None = None,
        seed: int | None = None,
        group_unseen: bool = False,
    ) -> dict[str, Any]:
        """``state``, if :meth:`load` would take it (see there), if its stream positions are
        of ``readers`` readers (where given: the loader's) and its seed is ``seed`` (where
        given: the loader's ``seed=``); raises otherwise. A state of an older format comes
        back migrated (see the module docstring). ``group_unseen``: the loader takes its
        rank's share once a process group exists; a rank's own state is checked then
        (:meth:`replace_sampling`)."""
        state = check_state_keys("DataLoader", state, ("epoch", "done", "seed"))
        with value_errors():  # a field of the wrong type is a ValueError too, as documented
            _check_done(state)
            state = self._current_format(state)
            _check_fields(state)
        if state["done"] and self._elastic(state):
            state = self._rebased(state)
        done = state["done"]
        if self._sampling.batches is None and done:
            self._check_stream(state)
            saved = state["streams"]
            if readers is not None and isinstance(saved, dict) and "readers" in saved:
                check_readers(saved["readers"], readers)
        tried, failure = self._tried(state)
        if not (group_unseen and self._rank() is None):
            self._check_rank(state)
        if done:  # counted in batch ids: the loader must cut and order them as the saver did
            self._check_layout(state, tried)
        self._check_sampler_state(state, exact=bool(done))
        if seed is not None and state["seed"] != seed:  # (before what follows from it)
            raise ValueError(
                f"state was saved with seed={state['seed']}, this loader has seed={seed}; "
                "pass the same seed (or none: the loader then adopts the saved one)"
            )
        if failure is not None:  # here, not at the epoch's first batch (the state kept)
            raise ValueError(
                f"the state's 'sampler' cannot be loaded into the samplers of this loader "
                f"({_chain_text(self._sampling.batches)}): {failure}"
            ) from failure
        self._check_carry(state)
        self._check_shuffle_seed(state)
        if state.get("generators") is not None:
            matching_generators(self._sampling.batches, state["generators"])
        return state

    def _elastic(self, state: dict[str, Any]) -> bool:
        """Whether a mid-epoch ``state`` was saved on another number of ranks (only the world
        size and what follows from it differ) and says which positions of the epoch's order
        every rank read: the rest of the epoch is then shared out over this loader's ranks."""
        saved, mine = state.get("layout"), self.layout()
        if not isinstance(saved, dict) or state.get("consumed") is None:
            return False
        if saved.get("replicas") == mine["replicas"]:
            return False  # the same ranks: the batch ids resume it, as always
        if not isinstance(self._sampling.sampler, DistributedSampler):
            return False
        return set(_differ(saved, mine)) <= _ELASTIC

    def _tried(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None, Exception | None]:
        """The layout of a copy of this loader's samplers with the state's sampler state
        loaded, or the error of that load (see :func:`layout_in_copy`); None where the layout
        does not depend on it: all but the rest of an elastic epoch (a sampler state holding
        ``"consumed"``, a layout that differs in the elastic fields alone)."""
        batches, saved, layout = self._sampling.batches, state.get("sampler"), state.get("layout")
        if batches is None or saved is None or state_holder(batches) is None:
            return None, None
        differ = set(_differ(layout, self.layout())) if isinstance(layout, dict) else set()
        if nested(saved, "consumed") is None or not differ or not differ <= _ELASTIC:
            return None, None
        return layout_in_copy(
            batches, self._sampling.sampler, self._dataset, saved, _chain_text(batches)
        )

    def _rebased(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (saved on other ranks) as the start of the rest of its epoch here: no
        batch taken yet, its sampler state holding the positions read (see
        :class:`~aioloader.DistributedSampler`)."""
        sampler = _copied(state.get("sampler"))
        inner = index_state(sampler)
        if inner is None:
            raise ValueError(
                "the state was saved on another number of ranks, but holds no state of its "
                "DistributedSampler: load it into a loader built the same way"
            )
        inner["consumed"] = state["consumed"]
        # The skip count was the saving rank's, of a share the new ranks do not have.
        rebased = {k: v for k, v in state.items() if k not in ("consumed", "failures")}
        layout = {**state["layout"], **{key: None for key in _ELASTIC}}
        return {**rebased, "done": [], "sampler": sampler, "layout": layout}

    def _current_format(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` in the format of :data:`STATE_VERSION`: migrated from an older one where
        that is sound, refused where it is not (see :func:`_migrated`); one from a newer
        aioloader is refused."""
        version = state.get("version", 0)
        if not is_int(version) or not 0 <= int(version) <= STATE_VERSION:
            raise ValueError(
                f"the state's format version is {version!r}; this aioloader reads versions 0 "
                f"to {STATE_VERSION}: load it with the aioloader that saved it (or a newer one)"
            )
        return state if version == STATE_VERSION else _migrated(state)

    def _check_layout(self, state: dict[str, Any], tried: dict[str, Any] | None) -> None:
        """Refuse a mid-epoch state whose batch ids are other samples in this loader
        (``tried``: the layout with the state's sampler state loaded, where known)."""
        saved, mine = state["layout"], tried if tried is not None else self.layout()
        rollover = "rollover" in (saved.get("last_batch"), mine["last_batch"])
        differ = [key for key in _differ(saved, mine) if not (key == "batches" and rollover)]
        if differ:  # (a carry rolled over changes len(loader) from epoch to epoch)
            raise ValueError(
                f"the state was saved mid-epoch ({_taken_text(state)}) by a loader with "
                f"{_layout_text(saved, differ)}; this one has {_layout_text(mine, differ)}. "
                "Its batches are other samples here, so resuming would repeat some and skip "
                "others: load it into a loader built the same way, or save the state between "
                f"epochs{_unsharded_hint(saved, mine)}"
            )
        batches = saved.get("batches")
        beyond = [i for i in state["done"] if is_int(batches) and i >= batches]
        if beyond:
            raise ValueError(
                f"the state's 'done' holds batch ids {beyond[:8]} that its epoch does not have: "
                f"it had {batches} batches (ids 0 to {batches - 1}). The state was edited, or "
                "put together from two states"
            )

    def _check_rank(self, state: dict[str, Any]) -> None:
        """Refuse a state that is another rank's own (see :meth:`_own_rank`), or of another
        number of ranks, naming both."""
        saved = state.get("rank")
        if saved is None:
            return
        replicas = (state.get("layout") or {}).get("replicas")  # (a dict or None: checked)
        mine, my_replicas = self._rank(), self.layout()["replicas"]
        if saved == mine and replicas in (None, my_replicas):
            return
        why = (
            "its batches were taken out of order (in_order=False), each rank's as they came"
            if state["done"] and nested(state.get("sampler"), "carry") in (None, [], ())
            else "it holds the samples its rollover carried (last_batch='rollover'), each "
            "rank's tail of its own share"
        )
        here = "is not sharded" if mine is None else f"reads rank {mine}'s share of {my_replicas}"
        keep = "{**state['sampler'], 'carry': []}" if state.get("sampler") else "None"
        raise ValueError(
            f"the state is rank {saved}'s of {replicas} ranks, and this loader {here}: {why}, "
            "so it resumes that rank only. Load each rank its own loader.state_dict() on as "
            f"many ranks. To go on here from this state alone, replay epoch {state['epoch']} "
            "from its start without the rank's rollover carry, keeping its sampler's seed and "
            f"epoch: load {{**state, 'rank': None, 'done': [], 'sampler': {keep}}}; later, save "
            "between epochs with in_order=True, last_batch 'keep' or 'discard' for other ranks"
        )

    def _check_carry(self, state: dict[str, Any]) -> None:
        """Refuse a rollover carry holding indices this loader's dataset does not have."""
        carry, samples = nested(state.get("sampler"), "carry"), length(self._dataset)
        if not isinstance(carry, list | tuple) or samples is None:
            return
        outside = [i for i in carry if not (is_int(i) and 0 <= int(i) < samples)]
        if outside:
            kind = "negative indices" if all(is_int(i) and i < 0 for i in outside) else "indices"
            raise ValueError(
                f"the state's rollover carry holds {kind} {outside[:8]} outside this loader's "
                f"dataset of {samples} samples (0 to {samples - 1}): it was saved over another "
                "dataset, or edited. Load it into a loader over the same dataset, or load "
                "{**state, 'sampler': None} between epochs to drop the carry"
            )

    def _check_sampler_state(self, state: dict[str, Any], *, exact: bool) -> None:
        """Refuse a sampler state saved by other samplers (shuffled or not, a generator or a
        seed), here rather than at the epoch's ``iter()``. Mid-epoch (``exact``) its keys must
        be those this loader's samplers save, or its order is not the one the batches were
        taken in; between epochs they must be keys these samplers read."""
        if exact and not isinstance(self._sampling.batches, Stateful):  # (previous release's)
            check_unsaved_order(self._sampling.batches, state)
        saved, mine = (
            sampler_keys(state.get("sampler")),
            sampler_keys(state_of(self._sampling.batches)),
        )
        if saved == mine or (not exact and keys_within(saved, mine)):
            return
        if saved is None and not isinstance(self._sampling.batches, Stateful):
            return  # saved before a sampler inside a stateless batch sampler was: resumed as then
        chain = _chain_text(self._sampling.batches)
        if exact:
            raise ValueError(
                f"the state's 'sampler' holds the keys {saved} but the samplers of this loader "
                f"({chain}) save {mine}: it was saved by other samplers ({_taken_text(state)}), "
                "so this loader's order would not be the one its batches were taken in: load "
                "it into a loader built the same way"
            )
        raise ValueError(
            f"the state's 'sampler' holds the keys {saved}, which the samplers of this loader "
            f"({chain}, saving {mine}) cannot read: it was saved by other samplers. Saved "
            "between epochs, it may start this loader's own order instead: load "
            "{**state, 'sampler': None} (a sample a rollover carried is then not carried)"
        )

    def _check_shuffle_seed(self, state: dict[str, Any]) -> None:
        """The shuffle the loader made is seeded with the loader's seed: a state whose sampler
        seed is another was edited, or put together from two states (its order would be the
        sampler seed's, its workers' randomness the other's)."""
        sampler, layout = self._sampling.sampler, state.get("layout")
        if not self._sampling.built or not isinstance(sampler, RandomSampler):
            return
        if sampler.generator is not None or not isinstance(layout, dict):
            return  # its order is the generator's state, which the state carries instead
        if layout.get("sampler") != "RandomSampler" or layout.get("generator") is not False:
            return  # saved by another sampler: its seed is not the loader's (between epochs)
        seed = nested(state.get("sampler"), "seed")
        if seed is not None and seed != state["seed"]:
            raise ValueError(
                f"the state's sampler seed is {seed!r} and its 'seed' is {state['seed']!r}: "
                "the shuffle a loader makes draws from the loader's seed, so the two are one "
                "in any state it saved. The state was edited, or put together from two states"
            )

    def _check_stream(self, state: dict[str, Any]) -> None:
        taken = len(state["done"])
        where = f"in epoch {state['epoch']} after {taken} batch{'es' if taken != 1 else ''}"
        replay = (
            f"to replay epoch {state['epoch']} from its start on purpose, load "
            "{**state, 'done': [], 'streams': None}"
        )
        if not isinstance(self._dataset, ResumableStream):
            raise ValueError(
                f"the state was saved mid-epoch ({where}) but dataset="
                f"{type(self._dataset).__name__} is a stream that cannot resume: it has no "
                "state_dict() / load_state_dict() (aioloader.ResumableStream). Loading it "
                "would silently repeat the batches already taken. Implement ResumableStream, "
                f"or save the state between epochs; {replay}"
            )
        if not state.get("streams"):
            raise ValueError(
                f"the state was saved mid-epoch ({where}) but holds no stream positions (was "
                f"it saved from a dataset that is not a ResumableStream?); {replay}"
            )


# -- every rank's state, merged (elastic resume of streams) -----------------------------------


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One loader state of every rank's, saved at one step, that resumes on any number of
    ranks and workers (see the module docstring).

    For a ``TarDataset`` or ``ParquetDataset`` the merged state holds what every rank consumed
    of the epoch (no batch taken yet: each new rank deals the rest out again). For map-style
    data rank 0's state already says it for all: the states must agree, and it comes back.
    Between epochs the states agree on the epoch, the seed and the samplers, and rank 0's
    comes back too.

    What the states do not share is each rank's own: under equal steps, the batches a rank
    read past the last agreed end and carries into its next epoch (``"equal_steps"``). The
    merged state holds every rank's (a rank's once, however many of its states there are),
    and each loader that loads it takes its part (``deal_carried``): on as many ranks as
    saved them, each rank its own; on another number, all of them dealt out in rank order.

    Args:
        states: ``loader.state_dict()`` of every rank (index = rank, or in any order), as
            ``torch.distributed.all_gather_object`` gathers them.

    Raises:
        ValueError: the states are of different epochs or seeds, of a stream that is not read
            in units (it resumes on the same ranks only), not one of each rank, or of ranks
            that read different data (a Parquet footer that failed on some ranks only).
    """
    if not states:
        raise ValueError("merge_states needs the state of every rank, got none")
    for k, state in enumerate(states):
        missing = [
            key
            for key in ("epoch", "done", "seed")
            if not isinstance(state, Mapping) or key not in state
        ]
        if missing:
            raise ValueError(
                f"merge_states: state {k} is not a loader's state_dict() (it lacks {missing}): "
                f"got {_shown(state)}"
            )
    first = dict(states[0])
    for k, state in enumerate(states):
        for key in ("epoch", "seed", "version"):
            if state.get(key) != first.get(key):
                raise ValueError(
                    f"merge_states: state {k} has {key}={state.get(key)!r} and state 0 has "
                    f"{key}={first.get(key)!r}: merge the states of one job, saved at one step"
                )
    streams = [state.get("streams") for state in states]
    if all(saved is None for saved in streams):
        for k, state in enumerate(states):
            if state.get("rank") is not None:
                raise ValueError(
                    f"merge_states: state {k} is rank {state['rank']}'s own (batches taken "
                    "out of order with in_order=False, or a rollover carry): such states "
                    "resume on the same ranks only, each rank from its own state_dict()"
                )
            for key in ("done", "consumed", "sampler"):
                try:
                    same = _same(state.get(key), first.get(key))
                except Exception as exc:
                    raise ValueError(
                        f"merge_states: state {k}'s {key!r} cannot be compared with state 0's "
                        f"({type(exc).__name__}: {exc}): {_shown(state.get(key))}"
                    ) from exc
                if not same:
                    raise ValueError(
                        f"merge_states: state {k}'s {key!r} ({_shown(state.get(key))}) differs "
                        f"from state 0's ({_shown(first.get(key))}): a map-style epoch is "
                        "shared out so that rank 0's state says it for all ranks, which these "
                        "do not; resume each rank from its own state_dict()"
                    )
        return _with_carried(_own_dropped(first), states)
    positions = []
    for k, saved in enumerate(streams):
        if not isinstance(saved, Mapping) or saved.get("readers") != 1:
            raise ValueError(
                f"merge_states: state {k}'s stream positions ({_shown(saved)}) are not of one "
                "reader of an async stream read in units (TarDataset, ParquetDataset): a stream "
                "read in worker processes resumes on the same ranks and workers only"
            )
        held = dict(saved["states"])
        position = held.get(0, held.get("0"))
        if not isinstance(position, Mapping):
            raise ValueError(f"merge_states: state {k} holds no position of its stream")
        positions.append(position)
    streams_state = {"readers": 1, "last": -1, "states": {0: merge_stream_states(positions)}}
    merged = {**_own_dropped(first), "done": [], "streams": streams_state}
    merged.pop("failures", None)  # one rank's skip count, and no batch taken any more
    return _with_carried(merged, states)


def _own_dropped(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` without what is its rank's own (see :func:`merge_states`)."""
    return {key: _copied(value) for key, value in state.items() if key != "equal_steps"}


def _with_carried(merged: dict[str, Any], states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``merged`` with the batches every rank carries into its next epoch (see
    :func:`merge_states`), a rank's once however many of its states there are (the ranks of
    one model-parallel group read one share)."""
    by_rank: dict[int, list[Any]] = {}
    worlds = set()
    for state in states:
        saved = state.get("equal_steps")
        if not isinstance(saved, Mapping):
            continue
        items, rank = saved.get("carried"), saved.get("rank")
        if not is_int(rank) or not isinstance(items, list | tuple):
            raise ValueError(
                "merge_states: a state's 'equal_steps' must be {'rank': int, 'world': int, "
                f"'carried': [[batch, samples, bytes], ...]}} (from state_dict()), got "
                f"{_shown(saved)}"
            )
        if items:
            by_rank[int(rank)] = [_copied(item) for item in items]
        if is_int(saved.get("world")):
            worlds.add(int(saved["world"]))
    if not by_rank:
        return merged
    batches = sum(len(items) for items in by_rank.values())
    distributed_log.info(
        "merge_states: %d batch%s that %d rank%s read past the last agreed end (equal steps) "
        "are in the merged state, handed first in the next epoch by the ranks that load it",
        batches,
        "" if batches == 1 else "es",
        len(by_rank),
        "" if len(by_rank) == 1 else "s",
    )
    merged["equal_steps"] = {
        "by_rank": [[rank, by_rank[rank]] for rank in sorted(by_rank)],
        "world": worlds.pop() if len(worlds) == 1 else None,
    }
    return merged


def deal_carried(saved: object, rank: int, replicas: int) -> list[Any] | None:
    """This rank's part of the carried batches a merged state holds (``saved``: its
    ``"equal_steps"``; see :func:`merge_states`): on as many ranks as saved them, rank
    ``rank``'s own; on another number, every rank's in rank order, dealt ``rank::replicas``.
    None where ``saved`` is a single rank's (``state_dict()``'s own form: the loader checks
    its rank).

    Raises:
        ValueError: ``saved`` is malformed (named with its value).
    """
    if not isinstance(saved, Mapping) or "by_rank" not in saved:
        return None
    by_rank, world = saved.get("by_rank"), saved.get("world")
    if (
        not isinstance(by_rank, list | tuple)
        or not all(
            isinstance(entry, list | tuple)
            and len(entry) == 2
            and is_int(entry[0])
            and isinstance(entry[1], list | tuple)
            for entry in by_rank
        )
        or not (world is None or is_int(world))
    ):
        raise ValueError(
            "state['equal_steps'] of a merged state must be {'by_rank': [[rank, [[batch, "
            "samples, bytes], ...]], ...], 'world': int or None} (from merge_states), got "
            f"{saved!r}"
        )
    if world == replicas:
        return next((list(items) for r, items in by_rank if r == rank), [])
    everything = [item for _, items in sorted(by_rank, key=lambda e: e[0]) for item in items]
    return everything[rank::replicas]


# -- the state's format ---------------------------------------------------------------------


def _migrated(state: dict[str, Any]) -> dict[str, Any]:
    """A state of format 0 (no ``"version"``) as format 1, where that is sound.

    Saved between epochs it holds no batch id: nothing of it depends on the settings, and its
    layout stays unknown (None: a layout is compared only mid-epoch). Saved mid-epoch it is
    refused: its batch ids count in settings it did not record (at most batch size and length,
    as ``"shape"``), so nothing can tell whether they are the same samples here; the message
    gives the two explicit ways on.
    """
    if not state["done"]:
        migrated = {key: value for key, value in state.items() if key != "shape"}
        return {**migrated, "version": STATE_VERSION, "layout": None}
    raise ValueError(
        f"the state has no 'version': it was saved mid-epoch ({_taken_text(state)}) by an "
        "older aioloader, whose states do not record the settings their batch ids count in "
        "(shuffle, the samplers, batch_size, last_batch, the lengths), so nothing tells "
        "whether resuming it here would repeat or skip samples. If this loader is built "
        "exactly as the saving one was, migrate it explicitly: load {**state, 'version': "
        f"{STATE_VERSION}, 'layout': loader.state_dict()['layout']}}; or replay the epoch from "
        "its start: load {**state, 'done': [], 'streams': None}"
    )


def _check_done(state: dict[str, Any]) -> None:
    """Refuse an ``epoch`` or ``done`` that is not what the book writes: a batch id is an int
    of the epoch's, each taken once."""
    epoch = non_negative_int("the state's 'epoch'", state["epoch"])
    done = state["done"]
    if not isinstance(done, list | tuple):
        raise TypeError(f"the state's 'done' must be a list of batch ids, got {done!r}")
    for batch_id in done:
        non_negative_int(f"each batch id in the state's 'done' (epoch {epoch})", batch_id)
    if len(set(done)) != len(done):
        twice = sorted({i for i in done if done.count(i) > 1})
        raise ValueError(f"the state's 'done' holds batch ids {twice[:8]} more than once")


def _check_fields(state: dict[str, Any]) -> None:
    """Refuse a field of the wrong type or out of its range, naming it and its value (before
    anything reads it: ``int('a')`` at the epoch's start said nothing of the state)."""
    to_int("the state's 'seed'", state["seed"])
    if "set_epoch" in state:
        boolean("the state's 'set_epoch'", state["set_epoch"])
    if state.get("rank") is not None:
        non_negative_int("the state's 'rank'", state["rank"])
    for key, kind in (("sampler", dict), ("generators", list), ("streams", dict)):
        value = state.get(key)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"the state's {key!r} must be a {kind.__name__} or None, got {value!r}")
    if state.get("streams") is not None:
        _check_streams(state["streams"])
    if state.get("failures") is not None:
        _check_failures(state["failures"])
    layout = state.get("layout")
    if not isinstance(layout, dict) and (layout is not None or state["done"]):
        raise TypeError(  # (None: a state of format 0 saved between epochs, migrated)
            f"the state's 'layout' must be a dict{'' if state['done'] else ' or None'}, "
            f"got {layout!r}"
        )


def _check_streams(streams: dict[str, Any]) -> None:
    """Refuse reader positions that name readers the state says there are not."""
    check_state_keys("DataLoader (the state's 'streams')", streams, ("readers", "last", "states"))
    readers = positive_int("the state's streams 'readers'", streams["readers"])
    last = to_int("the state's streams 'last'", streams["last"])
    if not -1 <= last < readers:
        raise ValueError(
            f"the state's streams 'last' is reader {last}, not one of its {readers} readers"
        )
    states = streams["states"]
    if not isinstance(states, dict):
        raise TypeError(f"the state's streams 'states' must be a dict, got {states!r}")
    for reader in states:
        try:
            number = int(reader)
        except (TypeError, ValueError):
            number = -1
        if not 0 <= number < readers:
            raise ValueError(
                f"the state's streams 'states' holds a position of reader {reader!r}, not one "
                f"of its {readers} readers"
            )


def _check_failures(failures: object) -> None:
    """Refuse a skip count that is not what the book writes (see :meth:`EpochBook.state_dict`)."""
    if not isinstance(failures, dict):
        raise TypeError(f"the state's 'failures' must be a dict or None, got {failures!r}")
    check_state_keys("DataLoader (the state's 'failures')", failures, ("rank", "seen", "skipped"))
    if failures["rank"] is not None:
        non_negative_int("the state's failures 'rank'", failures["rank"])
    seen = non_negative_int("the state's failures 'seen'", failures["seen"])
    skipped = failures["skipped"]
    if not isinstance(skipped, list | tuple):
        raise TypeError(
            f"the state's failures 'skipped' must be a list of sample indices, got {skipped!r}"
        )
    if len(skipped) > seen:
        raise ValueError(
            f"the state's failures say {len(skipped)} samples were skipped of {seen} seen: "
            "every skipped sample was seen. The state was edited, or put together from two "
            "states"
        )


def _differ(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The settings in which two layouts differ (one recorded later only where saved)."""
    return [
        key for key in LAYOUT if saved.get(key) != mine[key] and (key not in _ADDED or key in saved)
    ]


def _unsharded_hint(saved: dict[str, Any], mine: dict[str, Any]) -> str:
    """A hint where a state of several ranks meets a loader not sharded (yet)."""
    replicas = saved.get("replicas")
    if is_int(replicas) and int(replicas) > 1 and mine["replicas"] in (None, 1):
        return (
            ". A loader built before torch.distributed.init_process_group takes its rank's "
            "share once the group exists: load the state after init_process_group"
        )
    return ""


def _taken_text(state: dict[str, Any]) -> str:
    taken = len(state["done"])
    return f"epoch {state['epoch']}, {taken} batch{'es' if taken != 1 else ''} taken"


def _layout_text(layout: dict[str, Any], differ: list[str]) -> str:
    """The batch size and length (always, the shape of the batch ids), then each setting in
    ``differ``, by the names the loader's arguments have."""
    parts = [f"batch_size={layout.get('batch_size')} over {layout.get('samples')} samples"]
    for key in differ:
        if key not in ("batch_size", "samples"):
            value = layout.get(key)
            shown = repr(value) if key == "last_batch" else str(value)
            parts.append(f"{LAYOUT[key]}={shown}")
    return ", ".join(parts)


def _chain_text(batches: object) -> str:
    return " of ".join(type(s).__name__ for s in samplers(batches)) or "none"


def _copied(state: object) -> Any:
    """A copy of a state's nested dicts (the caller's state is never changed)."""
    if isinstance(state, dict):
        return {key: _copied(value) for key, value in state.items()}
    return state


def _same(one: object, other: object) -> bool:
    """Whether two states are equal, arrays and tensors (a generator's state) by value."""
    if isinstance(one, dict) and isinstance(other, dict):
        return one.keys() == other.keys() and all(_same(one[k], other[k]) for k in one)
    if isinstance(one, list | tuple) and isinstance(other, list | tuple):
        return len(one) == len(other) and all(map(_same, one, other))
    if isinstance(one, np.ndarray) or isinstance(other, np.ndarray):
        return type(one) is type(other) and np.array_equal(one, other)  # type: ignore[arg-type]
    equal = getattr(one, "equal", None)  # torch.Tensor
    if callable(equal) and type(one) is type(other):
        return bool(equal(other))
    return bool(one == other)


_SHORT = reprlib.Repr()  # a state's value in a message: a long 'done' list cut short
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 6
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def _shown(value: object) -> str:
    """``value`` for a message: its first items, and how many a list holds."""
    count = f" ({len(value)} items)" if isinstance(value, list | tuple) and len(value) > 6 else ""
    return _SHORT.repr(value) + count


# The layout's settings that follow from the number of ranks: a mid-epoch state that differs
# in these alone resumes elastically (see EpochBook._elastic).
_ELASTIC = frozenset({"replicas", "indices", "batches"})
