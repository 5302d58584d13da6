"""What a storage backend's failure means: not found, refused, worth another try, or a bug.

fsspec's filesystems fail with their backends' exceptions (botocore's ``ClientError``, aiohttp's
``ClientResponseError``), often translated (s3fs makes ``NoSuchKey`` a ``FileNotFoundError``
and ``SlowDown`` an ``OSError(EBUSY)``) or wrapped (fsspec's HTTP ``_info`` wraps *every*
failure in ``FileNotFoundError``). :func:`classify` reads the whole chain of causes and
contexts and answers with our vocabulary::

    NoSuchKey, 404 ─────────────────────────────────────▶ RemoteNotFoundError, no retry
    AccessDenied, 401, 403 ─────────────────────────────▶ RemotePermissionError, no retry
    SlowDown, throttling, EBUSY, policy.retry_statuses ─▶ RetryableError (Retry-After kept)
    timeouts, resets, short reads ──────────────────────▶ RetryableError (timeouts marked)
    FileNotFoundError, PermissionError (nothing above) ─▶ RemoteNotFoundError, ...Permission...
    anything else ──────────────────────────────────────▶ None: it propagates unchanged

Read top down: the first line that matches decides. So a ``FileNotFoundError`` wrapping a 503
(fsspec's HTTP ``_info``) is retried, and one wrapping a 404 is not found. Statuses are retried
as the policy's ``retry_statuses`` say (408, 425, 429, 500, 502, 503, 504 by default): another
5xx (501, 505, a proxy's 520-524) is final unless named there. A ``Retry-After`` header the
backend kept (aiohttp's ``ClientResponseError.headers``, botocore's ``HTTPHeaders``) goes with
the retry, so the wait honours it as :class:`~aioloader.sources.HTTPDataset`'s does.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping

from .._errors import RemoteNotFoundError, RemotePermissionError
from ._redact import redact
from ._retry import RetryableError, RetryPolicy, parse_retry_after

__all__ = ["classify"]

#: Error codes of S3-compatible stores that mean "try again later".
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
    }
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound", "404"})
PERMISSION_CODES = frozenset({"AccessDenied", "Forbidden", "InvalidAccessKeyId", "403"})

#: errno values s3fs gives transient S3 errors it translated (SlowDown/503 -> EBUSY,
#: InternalError/500 -> EREMOTEIO).
RETRYABLE_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO)})

#: botocore exception classes (by name, to avoid importing botocore) that are transient.
BOTOCORE_TRANSIENT = frozenset(
    {"ConnectionError", "HTTPClientError", "IncompleteReadError", "ResponseStreamingError"}
)


def _name(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _chain(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and its causes and contexts, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code carried anywhere in ``exc``'s chain."""
    for link in _chain(exc):
        response = getattr(link, "response", None)  # botocore ClientError
        if isinstance(response, Mapping):
            error = response.get("Error", {})
            meta = response.get("ResponseMetadata", {})
            code = error.get("Code") if isinstance(error, Mapping) else None
            status = meta.get("HTTPStatusCode") if isinstance(meta, Mapping) else None
            return (status if isinstance(status, int) else None), code
        status = getattr(link, "status", None)  # aiohttp ClientResponseError
        if isinstance(status, int) and not isinstance(status, bool):
            return status, None
    return None, None


def _retry_after(exc: BaseException) -> float | None:
    """The ``Retry-After`` header carried anywhere in ``exc``'s chain, in seconds."""
    for link in _chain(exc):
        headers = getattr(link, "headers", None)  # aiohttp ClientResponseError
        response = getattr(link, "response", None)  # botocore ClientError
        if isinstance(response, Mapping):
            meta = response.get("ResponseMetadata", {})
            headers = meta.get("HTTPHeaders") if isinstance(meta, Mapping) else None
        if isinstance(headers, Mapping):
            # aiohttp's headers ignore case; botocore's are lower case.
            value = headers.get("Retry-After", headers.get("retry-after"))
            if isinstance(value, str):
                return parse_retry_after(value)
    return None


def _is_transient_transport(exc: BaseException) -> bool:
    for link in _chain(exc):
        for klass in type(link).__mro__:
            module = klass.__module__
            if module.startswith("botocore") and klass.__name__ in BOTOCORE_TRANSIENT:
                return True
            if module.startswith("aiohttp") and klass.__name__ in (
                "ClientConnectionError",
                "ClientPayloadError",
            ):
                return True
    return False


def classify(exc: Exception, url: str, policy: RetryPolicy) -> Exception | None:
    """Our exception for a backend's failure, or ``None`` to let it propagate unchanged.

    A status or code in the chain decides first; then anything transient in the chain; the
    exception's type (``FileNotFoundError``, ``PermissionError``) only last, because fsspec's
    HTTP ``_info`` raises ``FileNotFoundError`` for *any* failure, a 503 or a reset included.
    """
    status, code = _status_and_code(exc)
    detail = redact(f"{url}: {_name(exc)}")  # a backend's text may hold the URL too
    if status == 404 or code in NOT_FOUND_CODES:
        return RemoteNotFoundError(detail, url=url)
    if status in (401, 403) or code in PERMISSION_CODES:
        return RemotePermissionError(detail, url=url)
    timed_out = any(isinstance(link, TimeoutError) for link in _chain(exc)) or any(
        "Timeout" in type(link).__name__ for link in _chain(exc)
    )
    what = f"{code} (HTTP {status})" if code else f"HTTP {status}" if status else None
    reason = redact(f"{what}: {_name(exc)}" if what else _name(exc))
    if (
        code in RETRYABLE_CODES
        or (status is not None and status in policy.retry_statuses)
        or timed_out
        or (isinstance(exc, OSError) and exc.errno in RETRYABLE_ERRNOS)
        or _is_transient_transport(exc)
    ):
        return RetryableError(
            ("timeout: " if timed_out else "") + reason,
            timed_out=timed_out,
            retry_after=_retry_after(exc),
        )
    if isinstance(exc, FileNotFoundError):
        return RemoteNotFoundError(detail, url=url)
    if isinstance(exc, PermissionError):
        return RemotePermissionError(detail, url=url)
    return None
