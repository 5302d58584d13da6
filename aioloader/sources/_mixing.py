"""Which shards a reader reads, in which order, and how their samples are mixed: pure functions
of (seed, epoch, share), so that a position in an epoch can be recomputed without the data.

Many shards are read at once, and their samples arrive in whatever order the network delivers
them. The order they are *used* in must not depend on that, or neither the shuffle nor resume
could be exact. So the :class:`Mixer` decides, as a state machine with no IO, which sample is
needed next, and the reader waits for that one (the other shards keep streaming meanwhile into
bounded queues)::

    shard order (seed, epoch)        open slots (shards_in_flight of them)
    [7, 2, 9, 4, ...] ──────▶  slot 0: shard 7, next position 3 ─┐ round-robin: the next
      this rank's share         slot 1: shard 2, next position 3 ─┤ sample needed is
                                slot 2: shard 9, next position 2 ─┘ slot 2's, position 2
                                        │ a shard that ends is replaced by the next in order
                                        ▼
                                shuffle buffer (``buffer`` samples, seeded by seed, epoch, rank):
                                each new sample replaces a random one, which is the output;
                                at the end the rest goes out in a random order

The mixer names samples by ``(shard, position)``. Given only how many samples each shard that
ended had, :func:`replay` reruns an epoch's first ``n`` outputs without reading anything, and
returns the mixer as it was then: its buffer says which samples must be read again, its slots
where each open shard continues. That is what makes resume exact (see :mod:`._tar`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

__all__ = ["Mixer", "replay", "shard_order"]

SampleId = tuple[int, int]  # (shard index, position of the sample in the shard)


def shard_order(
    shards: int, *, shuffle: bool, seed: int, epoch: int, reader: int, readers: int
) -> list[int]:
    """The shards reader ``reader`` of ``readers`` reads this epoch, in order.

    All readers draw the same permutation (it depends on ``(seed, epoch)`` only) and reader
    ``k`` takes every ``readers``-th shard of it from the ``k``-th on: together they read each
    shard once.
    """
    order = list(range(shards))
    if shuffle:
        random.Random(f"aioloader-shards/{seed}/{epoch}").shuffle(order)
    return order[reader::readers]


def buffer_rng(seed: int, epoch: int, reader: int, readers: int) -> random.Random:
    """The shuffle buffer's generator: one stream per (seed, epoch, reader)."""
    return random.Random(f"aioloader-buffer/{seed}/{epoch}/{reader}/{readers}")


class Mixer:
    """The order samples are read and yielded in; see the module docstring.

    Use: while ``want()`` names a sample, read it and call ``put(found)``, which may return a
    sample to yield; once ``want()`` is None, yield ``drain()``.

    Args:
        order: the shards to read, in order.
        slots: shards open at once (round-robin between them).
        buffer: samples held by the shuffle buffer (0 or 1: no shuffling).
        rng: the shuffle buffer's generator.
    """

    def __init__(self, order: Sequence[int], slots: int, buffer: int, rng: random.Random) -> None:
        self._order = order
        self._next_shard = min(slots, len(order))
        # Invariant: each slot is [shard, next position]; a slot whose shard ended is given the
        # next shard of the order, or removed when there is none.
        self.slots: list[list[int]] = [[shard, 0] for shard in order[: self._next_shard]]
        self._turn = 0
        self._size = buffer
        self._rng = rng
        self.buffer: list[SampleId] = []
        self.ended: dict[int, int] = {}  # shard -> its number of samples, once it ended

    def want(self) -> SampleId | None:
        """The sample to read next, or None when every shard ended."""
        if not self.slots:
            return None
        self._turn %= len(self.slots)
        shard, position = self.slots[self._turn]
        return shard, position

    def upcoming(self, n: int) -> Sequence[int]:
        """The next ``n`` shards of the order, not yet open (to start reading them early)."""
        return self._order[self._next_shard : self._next_shard + n]

    def put(self, found: bool) -> SampleId | None:
        """The answer to :meth:`want`: ``found`` False means that shard ended there. Returns
        the sample to yield now, if any."""
        slot = self.slots[self._turn]
        if not found:
            self.ended[slot[0]] = slot[1]
            if self._next_shard < len(self._order):
                self.slots[self._turn] = [self._order[self._next_shard], 0]
                self._next_shard += 1
            else:
                del self.slots[self._turn]  # the turn stays: it now points at the next slot
            return None
        sample = (slot[0], slot[1])
        slot[1] += 1
        self._turn += 1
        if self._size <= 1:
            return sample
        if len(self.buffer) < self._size:
            self.buffer.append(sample)
            return None
        j = self._rng.randrange(self._size)
        out, self.buffer[j] = self.buffer[j], sample
        return out

    def drain(self) -> list[SampleId]:
        """What the buffer holds at the end, in the order to yield it (once: it empties)."""
        rest, self.buffer = self.buffer, []
        self._rng.shuffle(rest)
        return rest


def replay(mixer: Mixer, counts: Mapping[int, int], outputs: int) -> list[SampleId]:
    """Run ``mixer`` without data until it has yielded ``outputs`` samples.

    ``counts`` has the number of samples of every shard that ended before that point (a shard
    not in it is taken to go on). Returns the samples still to yield from the drain, if the
    point lies in it (the mixer's buffer is then empty); otherwise ``[]``, and the mixer stands
    where the epoch stood.

    Raises:
        ValueError: the counts do not fit (fewer samples than ``outputs`` in all).
    """
    done = 0
    while done < outputs:
        want = mixer.want()
        if want is None:
            rest = mixer.drain()
            if done + len(rest) < outputs:
                raise ValueError(
                    f"the state says {outputs} samples were yielded, but its shards hold "
                    f"{done + len(rest)}"
                )
            return rest[outputs - done :]
        shard, position = want
        if mixer.put(position < counts.get(shard, position + 1)) is not None:
            done += 1
    return []
