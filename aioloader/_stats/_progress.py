"""Progress bars, one per epoch: ``DataLoader(progress=True)`` (tqdm, the ``progress`` extra).

::

    DataLoader(progress=...) ── progress_display(value) ──▶ ProgressDisplay (checked once)
    each epoch:  ProgressDisplay.epoch(n, total, counters) ──▶ EpochProgress
                 Epoch hands a batch over ──▶ EpochProgress.advance(samples, bytes)
                 the epoch ends or closes ──▶ EpochProgress.close()
    the loader closes ──▶ ProgressDisplay.close()

``progress`` may be ``True`` (a ``tqdm.tqdm`` bar per epoch), a callable that makes a bar from
tqdm's keyword arguments (``total``, ``desc``, ``unit``; ``tqdm.tqdm`` itself, or
``functools.partial(tqdm.tqdm, leave=False)``, or ``tqdm.auto.tqdm`` for notebooks), or a bar
made by the caller, which is reset at each epoch's start and closed with the loader. The bar
counts batches (tqdm shows their rate); its postfix shows samples/s, MB/s of batch data and the
share of time the consumer waited, refreshed at most every :data:`POSTFIX_INTERVAL_S`.

tqdm is imported only when ``progress=True`` is given: without the extra, that raises an
``ImportError`` naming it, at construction.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._counters import Counters, EpochStatistics

__all__ = ["POSTFIX_INTERVAL_S", "EpochProgress", "ProgressDisplay", "progress_display"]

#: The postfix (samples/s, MB/s, wait share) is recomputed at most this often: a snapshot of the
#: statistics costs microseconds, a batch may take less; tqdm redraws on its own schedule.
POSTFIX_INTERVAL_S = 0.5

PROGRESS_EXTRA_HINT = "pip install 'aioloader[progress]'"


@runtime_checkable
class Bar(Protocol):
    """What the loader uses of a tqdm bar."""

    def update(self, n: float = 1) -> Any: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...

    def reset(self, total: float | None = None) -> Any: ...

    def close(self) -> Any: ...


def progress_display(value: Any) -> ProgressDisplay | None:
    """Check ``DataLoader(progress=value)``; what makes each epoch's bar, or None for none.

    Raises:
        ImportError: ``progress=True`` without tqdm installed (names the extra).
        TypeError: neither a bool, a bar nor a callable.
    """
    if value is None or value is False:
        return None
    if value is True:
        try:
            tqdm = importlib.import_module("tqdm")
        except ImportError as exc:
            raise ImportError(
                "progress=True needs the 'tqdm' package, which is not installed: "
                f"{PROGRESS_EXTRA_HINT}"
            ) from exc
        return ProgressDisplay(factory=tqdm.tqdm)
    if isinstance(value, Bar) and not isinstance(value, type):
        return ProgressDisplay(shared=value)
    if callable(value):
        return ProgressDisplay(factory=value)
    raise TypeError(
        "progress must be True/False, a tqdm bar or a callable that makes one "
        f"(e.g. tqdm.tqdm), got {value!r}"
    )


class ProgressDisplay:
    """Makes a bar per epoch (``factory``) or reuses one (``shared``)."""

    def __init__(
        self, *, factory: Callable[..., Any] | None = None, shared: Bar | None = None
    ) -> None:
        self._factory = factory
        self._shared = shared

    def epoch(self, epoch: int, total: int | None, counters: Counters) -> EpochProgress:
        """The display of epoch ``epoch`` of ``total`` batches (None: unknown)."""
        if self._shared is not None:
            self._shared.reset(total=total)
            return EpochProgress(self._shared, counters, owned=False)
        assert self._factory is not None
        bar = self._factory(total=total, desc=f"epoch {epoch}", unit="batch")
        if not isinstance(bar, Bar):
            raise TypeError(
                f"progress={self._factory!r} made {bar!r}, which is not a progress bar "
                "(update, set_postfix_str, reset, close)"
            )
        return EpochProgress(bar, counters, owned=True)

    def close(self) -> None:
        """The loader closes: a bar it was given is closed too."""
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()


class EpochProgress:
    """One epoch's bar: advanced per batch, its postfix refreshed now and then.

    Args:
        bar: the bar.
        counters: the loader's live statistics (the postfix is read from them).
        owned: whether the bar is this epoch's to close (else it is only refreshed).
    """

    def __init__(self, bar: Bar, counters: Counters, *, owned: bool) -> None:
        self._bar = bar
        self._counters = counters
        self._owned = owned
        self._next_postfix = time.perf_counter() + POSTFIX_INTERVAL_S

    def advance(self, samples: int, nbytes: int) -> None:
        """One batch of ``samples`` samples and ``nbytes`` bytes was handed over."""
        self._bar.update(1)
        now = time.perf_counter()
        if now >= self._next_postfix:
            self._next_postfix = now + POSTFIX_INTERVAL_S
            self._bar.set_postfix_str(self.postfix(), refresh=False)

    def postfix(self, stats: EpochStatistics | None = None) -> str:
        """``'samples/s, MB/s, wait share'`` of ``stats``, or of the epoch so far."""
        s = stats if stats is not None else self._counters.measure()
        return (
            f"{s.samples_per_s:.1f} samples/s, {s.bytes_per_s / 1e6:.1f} MB/s, "
            f"wait {s.wait_share:.0%}"
        )

    def close(self, final: EpochStatistics | None = None) -> None:
        """The epoch ended (or closed) with statistics ``final`` (None: another epoch holds
        the statistics' clock): the final postfix, then the bar closes if ours."""
        self._bar.set_postfix_str(self.postfix(final), refresh=not self._owned)
        if self._owned:
            self._bar.close()
