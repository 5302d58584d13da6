"""Retries for remote reads: the policy, the backoff, and the loop that applies them.

Every remote source reads one object through :func:`retrying`, which calls a zero-argument
coroutine function (one *attempt*) until it returns, fails for good, or runs out of attempts::

    retrying(op) ──▶ op() ──returns──────────────────────────────▶ bytes
                      │
                      ├─raises RetryableError─▶ record the attempt ─▶ attempts left?
                      │                            yes: sleep(backoff or Retry-After), again
                      │                            no:  RetriesExhaustedError / RemoteTimeoutError
                      │
                      └─raises anything else──▶ propagates as it is (404, 403, a bug), with
                                                 the earlier attempts added as a note

The split of work: an attempt *classifies* its own failure (only it knows that an aiohttp
``ServerTimeoutError`` is a timeout or that S3's ``SlowDown`` is transient) by raising
:class:`RetryableError`; this module decides *whether and when* to try again. So one policy,
one backoff and one error format serve HTTP, S3, GCS and whatever comes next. The bookkeeping
(attempts so far, the wait after a failure, the final error) is :class:`Attempts`, a state
machine with no IO, so that a loop that cannot be one awaited call (a streamed body, which
hands out chunks between its attempts) waits and fails exactly as :func:`retrying` does.

Sharp edges:

- ``sleep`` and ``clock`` are injectable so tests run instantly and can assert the exact
  delays. ``deadline`` is enforced with :func:`asyncio.timeout`, i.e. on the event loop's own
  clock, because only the loop can interrupt an attempt that hangs.
- A ``Retry-After`` longer than ``backoff_max`` is cut to ``backoff_max``: no single wait of a
  data loader is longer than the user allowed, whatever the server says.
- Each attempt is counted in the statistics of the loader whose fetch awaits it (requests, in
  flight unless the attempt counts itself, retries, bytes returned; see
  :data:`aioloader._stats._counters.current_counters`), and each retry is logged at INFO on
  ``aioloader.remote`` with its cause and delay.
- What it shows is masked (:mod:`._redact`): ``describe`` and each attempt's outcome in the
  errors, their notes and the log records, and the chain of causes a traceback prints. The
  errors' ``url`` attribute is ``describe`` as given, for the program's own use.
- Cancellation is never caught here: an attempt that is cancelled (the consumer gave up, the
  loader closes) stops the whole read at once, without recording an attempt.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NoReturn, TypeVar

from .._errors import RemoteError, RemoteTimeoutError, RetriesExhaustedError
from .._log import remote_log
from .._stats import current_counters
from .._validate import (
    WrongTypeError,
    boolean,
    finite_number,
    is_int,
    positive_int,
    seconds,
    value_errors,
)
from ._redact import masked, redact, text_of

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "NEVER_RETRY_STATUSES",
    "Attempt",
    "Attempts",
    "RetryPolicy",
    "RetryableError",
    "parse_retry_after",
    "raise_final",
    "retrying",
]

T = TypeVar("T")

#: Statuses worth another try: timeouts, "too early", throttling and transient server errors.
DEFAULT_RETRY_STATUSES: frozenset[int] = frozenset({408, 425, 429, 500, 502, 503, 504})

#: The request itself is wrong or refused; asking again gives the same answer, only later.
NEVER_RETRY_STATUSES: frozenset[int] = frozenset({400, 401, 403, 404})


class RetryableError(Exception):
    """Raised by one attempt to say "this failed, but another attempt may succeed".

    It never reaches the caller of :func:`retrying`: it becomes one line of the final error's
    attempt list, and its ``__cause__`` (the library's own exception, if any) becomes the final
    error's cause.

    Args:
        reason: what happened, for the attempt list (``"HTTP 503 Service Unavailable"``).
        retry_after: seconds the server asked us to wait (``Retry-After``), if it did.
        timed_out: the attempt failed by a timeout; if the last attempt did, the final error is
            a :class:`~aioloader.RemoteTimeoutError` (also a ``TimeoutError``).
    """

    def __init__(self, reason: str, *, retry_after: float | None = None, timed_out: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class Attempt:
    """One failed attempt, as listed in the final error."""

    number: int
    outcome: str
    elapsed: float
    timed_out: bool = False

    def __str__(self) -> str:
        return f"attempt {self.number} ({self.elapsed:.3f} s): {self.outcome}"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently a remote read is retried.

    The wait before attempt ``n + 1`` is ``min(backoff_max, backoff_initial *
    backoff_multiplier ** (n - 1))``; with ``jitter`` ("full jitter") it is drawn uniformly
    from zero up to that, so clients that failed together do not come back together. When
    the server sends ``Retry-After`` (seconds or an HTTP date) and ``respect_retry_after`` is
    set, the wait is at least that long, but never more than ``backoff_max``.

    Statuses 400, 401, 403 and 404 are never retried, whatever ``retry_statuses`` says: the
    answer would not change.

    Args:
        max_attempts: attempts in all, the first one included (1 disables retries).
        backoff_initial: the wait after the first failure, in seconds.
        backoff_max: the longest single wait, in seconds.
        backoff_multiplier: growth of the wait per failure (>= 1).
        jitter: draw each wait uniformly from ``[0, wait]``.
        retry_statuses: HTTP statuses that count as transient.
        respect_retry_after: wait as long as the server's ``Retry-After`` asks (capped).

    Raises:
        ValueError: for a value out of range or of the wrong type (that one is also a
            ``TypeError``), naming the field and the value.
    """

    max_attempts: int = 5
    backoff_initial: float = 0.1
    backoff_max: float = 10.0
    backoff_multiplier: float = 2.0
    jitter: bool = True
    retry_statuses: frozenset[int] = field(default=DEFAULT_RETRY_STATUSES)
    respect_retry_after: bool = True

    def __post_init__(self) -> None:
        with value_errors():
            attempts = positive_int("RetryPolicy.max_attempts", self.max_attempts)
            initial = seconds("RetryPolicy.backoff_initial", self.backoff_initial, allow_none=False)
            cap = seconds("RetryPolicy.backoff_max", self.backoff_max, allow_none=False)
            multiplier = finite_number(
                "RetryPolicy.backoff_multiplier", self.backoff_multiplier, minimum=1.0
            )
            jitter = boolean("RetryPolicy.jitter", self.jitter)
            respect = boolean("RetryPolicy.respect_retry_after", self.respect_retry_after)
        if cap < initial:
            raise ValueError(
                f"RetryPolicy.backoff_max must be >= backoff_initial ({initial!r}), got {cap!r}"
            )
        statuses = _validate_statuses(self.retry_statuses)
        # Normalise through object.__setattr__: the dataclass is frozen (the documented idiom).
        object.__setattr__(self, "max_attempts", attempts)
        object.__setattr__(self, "backoff_initial", initial)
        object.__setattr__(self, "backoff_max", cap)
        object.__setattr__(self, "backoff_multiplier", multiplier)
        object.__setattr__(self, "jitter", jitter)
        object.__setattr__(self, "respect_retry_after", respect)
        object.__setattr__(self, "retry_statuses", statuses)

    def backoff(self, failures: int, *, rand: Callable[[], float] = random.random) -> float:
        """The wait after the ``failures``-th failed attempt (1-based), before any Retry-After.

        Args:
            failures: how many attempts have failed so far (>= 1).
            rand: a source of uniform numbers in ``[0, 1)``, for jitter.
        """
        with value_errors():
            failures = positive_int("failures", failures)
        try:
            wait = self.backoff_initial * self.backoff_multiplier ** (failures - 1)
        except OverflowError:  # a huge exponent: the cap applies anyway
            wait = self.backoff_max
        wait = min(self.backoff_max, wait)
        return wait * rand() if self.jitter else wait

    def delay(
        self,
        failures: int,
        retry_after: float | None = None,
        *,
        rand: Callable[[], float] = random.random,
    ) -> float:
        """The wait before the next attempt: the backoff, raised to ``retry_after`` if asked.

        Args:
            failures: how many attempts have failed so far (>= 1).
            retry_after: the server's ``Retry-After`` in seconds, if any.
            rand: a source of uniform numbers in ``[0, 1)``, for jitter.
        """
        wait = self.backoff(failures, rand=rand)
        if retry_after is not None and self.respect_retry_after:
            wait = max(wait, min(max(retry_after, 0.0), self.backoff_max))
        return wait


def _validate_statuses(statuses: Iterable[int]) -> frozenset[int]:
    def refuse(why: str, error: type[ValueError] = ValueError) -> ValueError:
        return error(f"RetryPolicy.retry_statuses {why}, got {statuses!r}")

    try:
        given = frozenset(statuses)
    except TypeError:
        raise refuse("must be a set of HTTP statuses", WrongTypeError) from None
    codes: set[int] = set()
    for status in given:
        if not is_int(status):
            raise refuse(
                f"must hold HTTP statuses (ints), and {status!r} is not one", WrongTypeError
            )
        if not 100 <= int(status) <= 599:
            raise refuse(f"must hold HTTP statuses (100-599), and {status!r} is not one")
        codes.add(int(status))
    result = frozenset(codes)
    refused = sorted(result & NEVER_RETRY_STATUSES)
    if refused:
        raise refuse(f"must not contain {refused}: 400, 401, 403 and 404 are never retried")
    return result


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date.

    Returns ``None`` for a missing or malformed header (which is then ignored, not an error:
    a server's typo must not fail a training run), and ``0.0`` for a date in the past.
    """
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def _give_up(
    describe: str, attempts: list[Attempt], why: str, *, deadline: bool = False
) -> RemoteError:
    """The final error: a timeout if the deadline ended it or the last attempt timed out."""
    lines = "\n".join(f"  {a}" for a in attempts)
    message = f"{redact(describe)}: {why}; attempts:\n{lines}"
    timed_out = deadline or (bool(attempts) and attempts[-1].timed_out)
    cls = RemoteTimeoutError if timed_out else RetriesExhaustedError
    return cls(message, url=describe, attempts=tuple(str(a) for a in attempts))


class Attempts:
    """The attempts of one remote read so far, and what follows a failed one: wait, or give up.

    A synchronous state machine (no IO, no sleeping), shared by the two loops that read
    remotely: :func:`retrying`, where one attempt is one awaited call, and a streamed body
    (:meth:`HTTPDataset.stream <aioloader.sources.HTTPDataset.stream>`), where one attempt is
    a request and the part of the body it delivered. So a read that fails waits the same
    jittered exponential backoff and ends with the same error, whichever loop made it.

    Invariant: ``failures`` lists every attempt that failed, in order; the attempt being made
    is number ``len(failures) + 1``, never more than ``policy.max_attempts``.

    Args:
        policy: attempts, backoff and Retry-After handling.
        describe: the resource, as the errors name it (a URL); also the errors' ``url``.
        deadline: seconds for all attempts and waits together, or ``None`` for no limit.
        clock: monotonic seconds, for the elapsed times in the attempt list.
        rand: uniform numbers in ``[0, 1)`` for jitter.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        describe: str,
        *,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self.describe = describe
        self.shown = redact(describe)  # what messages and logs say
        self.deadline = deadline
        self.failures: list[Attempt] = []
        self._clock = clock
        self._rand = rand
        self._start = clock()
        self._counters = current_counters.get()

    @property
    def number(self) -> int:
        """The number of the attempt being made (1-based)."""
        return len(self.failures) + 1

    def begin(self) -> float:
        """Count a new attempt as a request; returns when it began (for :meth:`failed`)."""
        if self._counters is not None:
            self._counters.remote_requests += 1
        return self._clock()

    def time_left(self, began: float) -> float | None:
        """Seconds of the deadline left to an attempt that began at ``began`` (``None``: no
        deadline)."""
        return None if self.deadline is None else self.deadline - (began - self._start)

    def failed(self, failure: RetryableError, began: float) -> float:
        """Record the attempt that began at ``began`` and failed with ``failure``; returns the
        wait before the next attempt (logged at INFO, counted as a retry).

        Raises:
            RetriesExhaustedError: that was the last attempt (a ``RemoteTimeoutError`` if it
                timed out), listing every attempt; caused by the failure's cause.
            RemoteTimeoutError: the wait would pass the deadline.
        """
        number = self.number
        reason = redact(failure.reason)
        self.failures.append(Attempt(number, reason, self._clock() - began, failure.timed_out))
        policy = self.policy
        # Masked in place, the failure's whole chain: the caller may fail from inside the
        # clause that caught it, which makes it the final error's __context__.
        masked(failure)
        cause = failure.__cause__ or failure
        if number >= policy.max_attempts:
            why = f"gave up after {number} attempts (max_attempts={policy.max_attempts})"
            raise _give_up(self.describe, self.failures, why) from cause
        wait = policy.delay(number, failure.retry_after, rand=self._rand)
        deadline = self.deadline
        if deadline is not None and self._clock() + wait - self._start >= deadline:
            why = f"gave up: waiting {wait:.3f} s more would pass the {deadline} s deadline"
            raise _give_up(self.describe, self.failures, why, deadline=True) from cause
        if self._counters is not None:
            self._counters.remote_retries += 1
        remote_log.info(
            "retrying %s in %.3f s (attempt %d of %d failed): %s",
            self.shown,
            wait,
            number,
            policy.max_attempts,
            reason,
        )
        return wait

    def expired(self, began: float, exc: BaseException) -> RemoteError:
        """The final error for the attempt that began at ``began`` and was ended by the
        deadline; its ``__cause__`` is ``exc`` (what the attempt raised), masked."""
        outcome = f"item deadline of {self.deadline} s passed"
        self.failures.append(Attempt(self.number, outcome, self._clock() - began, timed_out=True))
        error = _give_up(self.describe, self.failures, "deadline passed", deadline=True)
        error.__cause__ = masked(exc)
        return error

    def final(self, exc: Exception, began: float) -> BaseException:
        """Give ``exc``, a failure that is not retried, the history of the attempts before it,
        and mask what it shows; returns what to raise: ``exc``, or where its type prints a
        secret that cannot be masked in place, a :class:`~aioloader.RemoteError` saying it."""
        last = Attempt(self.number, redact(text_of(exc)), self._clock() - began)
        _annotate(exc, self.shown, self.failures, last)
        shown = masked(exc)
        if shown is exc:
            return exc
        attempts = tuple(str(a) for a in [*self.failures, last])
        error = RemoteError(f"{self.shown}: {shown}", url=self.describe, attempts=attempts)
        error.__cause__ = shown
        return error


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    describe: str,
    deadline: float | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rand: Callable[[], float] = random.random,
    count_in_flight: bool = True,
) -> T:
    """Await ``op()`` until it succeeds, following ``policy``.

    Args:
        op: one attempt; raises :class:`RetryableError` for a transient failure, anything
            else for a final one.
        policy: attempts, backoff and Retry-After handling.
        describe: the resource, as the errors name it (a URL); also the errors' ``url``.
        deadline: seconds for all attempts and waits together, or ``None`` for no limit.
        sleep: awaited between attempts with the delay in seconds (tests record it).
        clock: monotonic seconds, for the elapsed times in the attempt list.
        rand: uniform numbers in ``[0, 1)`` for jitter.
        count_in_flight: count each attempt in ``requests_in_flight`` while ``op`` runs;
            ``False`` when ``op`` counts itself (HTTP counts from the moment a request has a
            connection, not while it waits for one).

    Returns:
        What ``op`` returned.

    Raises:
        RemoteTimeoutError: the deadline passed (or would have during the next wait), or the
            attempts ran out and the last one timed out (also a ``TimeoutError``).
        RetriesExhaustedError: the attempts ran out otherwise. Its message names ``describe``
            and lists every attempt; ``__cause__`` is the last failure's cause.
        Exception: whatever ``op`` raised that is not a :class:`RetryableError`, unchanged,
            with a note listing the earlier attempts.
    """
    with value_errors():
        deadline = seconds("deadline", deadline, positive=True)
    attempts = Attempts(policy, describe, deadline=deadline, clock=clock, rand=rand)
    counters = current_counters.get() if count_in_flight else None
    while True:
        began = attempts.begin()
        left = attempts.time_left(began)
        scope: asyncio.Timeout | None = None
        error: BaseException | None = None
        if counters is not None:
            counters.remote_in_flight += 1
        try:
            if left is None:
                result = await op()
            else:
                async with asyncio.timeout(left) as scope:
                    result = await op()
            done = current_counters.get()
            if done is not None and isinstance(result, bytes | bytearray | memoryview):
                done.remote_bytes += len(result)
            return result
        except RetryableError as exc:
            failure = exc
        except Exception as exc:
            if scope is not None and scope.expired():
                error = attempts.expired(began, exc)
            else:
                error = attempts.final(exc, began)
                if error is exc:
                    raise
        finally:
            if counters is not None:
                counters.remote_in_flight -= 1
        if error is not None:
            # Raised outside the except clause: there, the exception it stands for would
            # become its __context__, unmasked (see raise_final).
            raise_final(error)
        await sleep(attempts.failed(failure, began))


def raise_final(error: BaseException) -> NoReturn:
    """Raise ``error``, a final error that stands for a failure whose text cannot be shown
    (:meth:`Attempts.final`, :meth:`Attempts.expired`), from its masked cause.

    Call it outside the ``except`` clause that caught the failure: raised inside, the failure
    itself would become the error's ``__context__``, reachable unmasked.
    """
    raise error from error.__cause__


def _annotate(exc: Exception, describe: str, attempts: list[Attempt], last: Attempt) -> None:
    """Give a final (non-retryable) failure the history of the attempts before it."""
    if isinstance(exc, RemoteError) and not exc.attempts:
        exc.attempts = (*(str(a) for a in attempts), str(last))
    if attempts:
        exc.add_note(f"earlier attempts of {describe}:")
        for attempt in attempts:
            exc.add_note(f"  {attempt}")
