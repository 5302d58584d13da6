"""One batch under its deadline: attempts, retries after a crash or a hang, the timeout error.

::

    produce task ──attempt()──▶ runner future ──(done)──▶ Made
         │  a look every timeout/LOOKS s: is the runner working on it (not merely queued)?
         │     seen running for `timeout` s ─▶ runner.on_deadline: the worker is killed
         │                                     ─▶ retry or LoaderTimeoutError
         │     queued ─▶ its clock starts again: time queued behind another batch is not its time
         └─ WorkerCrashedError ─▶ retry (max_retries) or the error, annotated with the batch

Deadlines measure producer time: a batch's clock starts when its attempt starts (after its
permit was taken), so a slow consumer never causes a timeout, and runs only while the runner
works on it. A batch has run at least ``timeout`` when it is stopped (counted from the first
look that saw it running), and at most ``timeout`` plus two looks. A retry is a fresh attempt
with a fresh clock.

Cancellation edges: cancelling the waiting task cancels the attempt's future (a runner then
releases what the job held once its worker is done with it) and re-raises.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .._batch import annotate
from .._errors import WorkerCrashedError, timeout_error
from .._log import workers_log
from .._stats import Counters
from .._types import BatchRequest, Made, Runner, StreamRequest

__all__ = ["LOOKS", "DeadlinePolicy", "run_attempts", "timeout_error"]

#: Looks per deadline at whether a batch runs. More: a batch is stopped closer to its deadline
#: after it began running (at most 2/LOOKS of it late); fewer: fewer wake-ups per batch.
LOOKS = 8


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """How long a batch may take and how often it is re-run.

    Attributes:
        timeout: seconds of producer time per attempt, or None for no limit.
        max_retries: re-runs of a batch whose worker crashed or hung.
        clock: monotonic seconds, for the elapsed time in errors (injectable in tests).
    """

    timeout: float | None
    max_retries: int
    clock: Callable[[], float] = field(default=time.monotonic)


async def run_attempts(
    attempt: Callable[[], Awaitable[Made]],
    *,
    request: BatchRequest | StreamRequest,
    describe: Callable[[], str],
    runner: Runner,
    policy: DeadlinePolicy,
    counters: Counters,
    retry: bool = True,
) -> Made:
    """Run ``attempt`` under the batch deadline, re-running it after crashes and hangs if asked.

    Args:
        attempt: starts one attempt and returns what to await for its :class:`Made`.
        request: the batch's request, the object ``attempt`` gives the runner: the runner is
            asked about it (running? kill it), its batch id named in errors.
        describe: what the batch is (its indices, a stream), for errors; called only then.
        runner: where the batch runs (asked whether it is running, and to kill it).
        policy: the deadline and retry settings.
        counters: the loader's live statistics (timeouts, retries).
        retry: whether this batch may be re-run (a stream's batch cannot be re-read).

    Raises:
        LoaderTimeoutError: the batch missed its deadline on its last attempt.
        WorkerCrashedError: its worker died on its last attempt (annotated with the batch).
        BaseException: the user's own error from making the batch, unchanged.
    """
    batch_id = request.batch_id
    may_retry = retry and policy.max_retries > 0
    if policy.timeout is None and not may_retry:
        # The common case, kept lean: no extra task per batch.
        try:
            return await attempt()
        except WorkerCrashedError as exc:
            annotate(exc, f"batch {batch_id}: {describe()}")
            raise
    tries = 0
    while True:
        job = asyncio.ensure_future(attempt())
        try:
            timed_out, started = await _await_job(job, request, runner, policy)
        except WorkerCrashedError as exc:
            if may_retry and tries < policy.max_retries:
                tries += 1
                counters.retries += 1
                _log_rerun(batch_id, tries, policy.max_retries, f"its worker crashed: {exc}")
                continue
            annotate(exc, f"batch {batch_id}: {describe()}")
            raise
        if not timed_out:
            return job.result()
        counters.timeouts += 1
        pid = runner.on_deadline(request)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        if may_retry and tries < policy.max_retries:
            tries += 1
            counters.retries += 1
            killed = f", worker pid {pid} killed" if pid is not None else ""
            why = f"it passed its {policy.timeout} s deadline{killed}"
            _log_rerun(batch_id, tries, policy.max_retries, why)
            continue
        cause = getattr(runner, "deadline_cause", None)  # Ray actors: one not placed, say
        known: str | None = cause(request) if cause is not None else None
        advice = {} if known is None else {"advice": known}
        raise timeout_error(
            batch_id, describe(), policy.clock() - started, policy.timeout, pid, **advice
        )


def _log_rerun(batch_id: int, retry: int, retries: int, why: str) -> None:
    workers_log.warning(
        "re-running batch %d now (retry %d of max_retries=%d): %s", batch_id, retry, retries, why
    )


async def _await_job(
    job: asyncio.Future[Any],
    request: BatchRequest | StreamRequest,
    runner: Runner,
    policy: DeadlinePolicy,
) -> tuple[bool, float]:
    """Wait for ``job``; ``(True, start)`` once it ran past the deadline, else ``(False, _)``
    with the job done (its exception, if any, raised)."""
    timeout = policy.timeout
    started = policy.clock()
    try:
        if timeout is None:
            await asyncio.wait([job])
        else:
            loop = asyncio.get_running_loop()
            running_since: float | None = None  # the first look that saw it running
            while True:
                done, _ = await asyncio.wait([job], timeout=timeout / LOOKS)
                if done:
                    break
                if not runner.is_running(request):
                    running_since = None
                    started = policy.clock()  # still queued: its time has not begun
                elif running_since is None:
                    running_since = loop.time()  # it began since the last look
                elif loop.time() - running_since >= timeout:
                    return True, started
    except asyncio.CancelledError:
        job.cancel()
        raise
    job.result()  # raises the job's exception
    return False, started
