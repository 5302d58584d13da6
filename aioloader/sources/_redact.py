"""Secrets in URLs: the one rule that masks them wherever a URL or a path is shown.

The URLs people reach training data with carry credentials: presigned object-store URLs
(``X-Amz-Signature=...``, ``X-Goog-Signature=...``), Azure SAS URLs (``sig=...``), tokens in
query strings, ``https://user:password@host/...``. What the sources show goes where secrets
must not: experiment trackers, CI logs, shared notebooks, issue threads. So everything they
show passes :func:`redact`, and every exception that leaves them passes :func:`masked`::

    "https://u:pw@host/a.bin?X-Amz-Signature=abc&size=3"
        │ userinfo password (a name alone too) ▶ "u:REDACTED@" ("REDACTED@")
        │ query values of credential names   ─▶ "X-Amz-Signature=REDACTED"
        ▼ everything else kept (which object failed stays said)
    "https://u:REDACTED@host/a.bin?X-Amz-Signature=REDACTED&size=3"

Where it applies: error messages and notes, the attempts list, log records, ``repr`` of
datasets, skip records and statistics (they hold the errors' text). Where it does not: the
request itself, and the values a program reads back (``dataset.urls``, a ``RemoteError``'s
``url`` attribute, a tar sample's ``__url__``), which are the data as given.

Sharp edges:

- The rule works on text, not on parsed URLs: a message holds a URL among words, quoted, or in
  a library's ``repr`` (``URL('...')``). A query value ends at ``&``, ``#``, ``;``, white space
  or a quote (a fragment's ``#name=value`` is read as a query's); a password at the last ``@``
  of the authority. A user name without a password is masked whole (a token given as the
  user name cannot be told from a name). A password with an unescaped ``/``, ``?`` or ``#``
  (``https://u:pa#ss@host/``, which ``HTTPDataset`` refuses) is masked up to the last ``@``
  of its run of text, where what follows the colon is no port.
- Exceptions of other libraries name the URL in their own words (aiohttp's
  ``ClientResponseError`` prints ``url='...'``, fsspec raises ``FileNotFoundError(url)``), and a
  traceback prints the whole chain of causes and contexts. :func:`masked` masks their
  arguments in place; one whose text or ``repr`` still carries a secret (it formats
  attributes), or that keeps the request it failed (its headers: ``Authorization`` is no URL,
  and shows in the ``repr`` of aiohttp's errors), is replaced in the chain by a
  :class:`MaskedError` naming its type, with its traceback.
- Names added by :func:`add_credential_parameters` are this process's; the sources carry them
  in their pickles (:func:`parameters_state`), so worker processes mask what they show alike.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.parse
from collections.abc import Sequence

__all__ = [
    "CREDENTIAL_PARAMETERS",
    "CREDENTIAL_SUFFIXES",
    "MARKER",
    "REQUEST_ATTRIBUTES",
    "MaskedError",
    "add_credential_parameters",
    "masked",
    "parameters_state",
    "redact",
    "same_objects",
    "text_of",
]

#: What a masked secret reads as.
MARKER = "REDACTED"

#: Query parameters whose values are credentials, compared without case: the object stores'
#: signatures, credentials and security tokens (S3 v2 and v4, GCS v2 and v4), Azure SAS's
#: ``sig``, and common token and key names. A name wrongly here costs one value not shown;
#: one missing leaks a secret, so the list errs on masking.
CREDENTIAL_PARAMETERS: frozenset[str] = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "signature",
        "awsaccesskeyid",
        "googleaccessid",
        "sig",
        "token",
        "access_token",
        "id_token",
        "refresh_token",
        "auth",
        "key",
        "apikey",
        "api_key",
        "api-key",
        "password",
        "passwd",
        "pwd",
        "secret",
        "client_secret",
    }
)

#: Any parameter whose name ends with one of these (``sessiontoken``, ``X-Auth-Token``,
#: ``upload_signature``) is masked too.
CREDENTIAL_SUFFIXES = ("token", "signature", "secret", "password", "credential")

_added: set[str] = set()

# scheme://userinfo@: the userinfo runs to the *last* "@" of the authority (a password typed
# with an unescaped "@" is all masked); "/", "?", "#" or a space end the authority first, so
# "host:port/path" and an "@" in a path never match.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^\s/?#'\"<>]*)@")
# scheme://user:password@ whose password holds an unescaped "/", "?" or "#" (a URL no parser
# reads as meant): a colon after the user name followed by what is no port (digits up to "/",
# "?", "#"), up to the last "@" of the token. Errs on masking: the "@" of a path after a bad
# port is taken for the end of a password.
# Linear: a scheme starts where no scheme character stands before it, and the token stops at
# the next "://" (else each "a://b:" of a long text scanned the rest of it: quadratic). An
# authority starting with "[" is an IPv6 host, whose colons are no password's.
_LOOSE_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.\-])([A-Za-z][A-Za-z0-9+.\-]*://)([^\s/?#@:\['\"<>]*)"
    r":((?:(?!://)[^\s'\"<>])*)@"
)
_PORT_END = re.compile(r"[/?#]")
# ?name=value or &name=value (";" too, and "#": tokens travel in fragments): the value ends at
# "&", "#", ";", a space or a quote.
_PARAMETER = re.compile(r"([?&;#])([^=&#;\s'\"<>?]+)=([^&#;\s'\"<>]*)")


def add_credential_parameters(*names: str) -> None:
    """Mask the values of these query parameters too, wherever a URL is shown.

    For credentials under names of your own (``?my_auth=...``); compared without case. The
    default list covers the object stores' presigned URLs, Azure SAS and common token names
    (see docs/guides/secrets-and-size-bounds.md). Applies to this process, and to worker processes
    through the datasets made or pickled after the call.

    Example::

        aioloader.sources.add_credential_parameters("my_auth", "X-Custom-Key")

    Raises:
        TypeError: a name that is not a non-empty string, naming it.
    """
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a parameter name must be a non-empty string, got {name!r}")
    _added.update(name.lower() for name in names)


def parameters_state() -> tuple[str, ...]:
    """The names :func:`add_credential_parameters` added, for a source's pickle."""
    return tuple(sorted(_added))


def _is_credential(name: str) -> bool:
    lowered = name.lower()
    return (
        lowered in CREDENTIAL_PARAMETERS
        or lowered in _added
        or lowered.endswith(CREDENTIAL_SUFFIXES)
    )


def _parameter(match: re.Match[str]) -> str:
    if not match.group(3) or not _is_credential(match.group(2)):
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}={MARKER}"


def _userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match.group(2).partition(":")
    if not match.group(2):
        return match.group(0)
    # user:password keeps the user; a name alone is masked whole: a token is often given as
    # the user (https://TOKEN@host/, GitHub's and GitLab's form).
    return f"{match.group(1)}{user}:{MARKER}@" if colon else f"{match.group(1)}{MARKER}@"


def _loose_userinfo(match: re.Match[str]) -> str:
    rest = match.group(3)
    head = _PORT_END.split(rest, maxsplit=1)[0]
    if head == rest or head.isdigit():
        return match.group(0)  # a common user info (the strict rule's), or a port
    return f"{match.group(1)}{match.group(2)}:{MARKER}@"


#: Query parameters that say when or by whom a URL may be used rather than what it names:
#: expiry and signing parameters of presigned URLs (S3, GCS, CloudFront, Azure SAS). With the
#: credential parameters, :func:`same_objects` leaves them out.
EXPIRY_PARAMETERS: frozenset[str] = frozenset(
    {
        "expires",
        "expiry",
        "policy",
        "key-pair-id",
        # Azure SAS: version, services, resource types, permissions, start, expiry,
        # protocol, resource, identifier, key fields
        "sv",
        "ss",
        "srt",
        "sp",
        "st",
        "se",
        "spr",
        "sr",
        "si",
        "sdd",
        "skoid",
        "sktid",
        "skt",
        "ske",
        "sks",
        "skv",
    }
)

#: Parameters of these prefixes are all signing parameters (``X-Amz-Date``, ``X-Goog-Expires``).
SIGNING_PREFIXES = ("x-amz-", "x-goog-")


#: Signing fields that only the signature they sit beside makes meaningless: each family is
#: left out of a URL only when that URL carries the family's signature (``?sp=train`` of an
#: unsigned URL names a split, and is kept).
_SIGNED_FAMILIES: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    ("sig", EXPIRY_PARAMETERS, ()),  # Azure SAS
    ("x-amz-signature", frozenset(), ("x-amz-",)),
    ("x-goog-signature", frozenset(), ("x-goog-",)),
    # CloudFront, GCS v2
    ("signature", frozenset({"expires", "expiry", "policy", "key-pair-id"}), ()),
)


def _is_signature(name: str) -> bool:
    return name == "sig" or name.endswith("signature")


def _query_pairs(url: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``url`` less its user info and query, and its query as (raw pair, lowered name, value)."""
    if "://" not in url:
        return url, []
    parts = urllib.parse.urlsplit(url)
    pairs = []
    for pair in parts.query.split("&"):
        if pair:
            name, _, value = pair.partition("=")
            pairs.append((pair, urllib.parse.unquote_plus(name).lower(), value))
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}", pairs


def _signing_fields(names: set[str]) -> tuple[set[str], tuple[str, ...]]:
    dropped: set[str] = set()
    prefixes: tuple[str, ...] = ()
    for signature, fields, family_prefixes in _SIGNED_FAMILIES:
        if signature in names:
            dropped |= fields
            prefixes += family_prefixes
    return dropped, prefixes


def _hashed(value: str) -> str:
    return "#" + hashlib.sha256(value.encode()).hexdigest()[:16]


def _what_they_name(urls: Sequence[str]) -> list[str]:
    """Each URL less what may change while it names the same object: its user info, its
    signatures, the signing fields of a signed URL (its expiry, Azure's SAS fields, the
    ``X-Amz-*`` of one with ``X-Amz-Signature``), and a credential parameter whose value is
    the same on every URL. A credential parameter whose value differs per URL names the
    object (``/dl?key=train-0001.tar``): kept, its value hashed, never in clear."""
    parsed = [_query_pairs(url) for url in urls]
    values: dict[str, set[str]] = {}
    for _, pairs in parsed:
        for _, name, value in pairs:
            values.setdefault(name, set()).add(value)
    names = []
    for base, pairs in parsed:
        dropped, prefixes = _signing_fields({name for _, name, _ in pairs})
        kept = []
        for pair, name, value in pairs:
            if _is_signature(name) or name in dropped or (prefixes and name.startswith(prefixes)):
                continue
            if _is_credential(name):
                if len(values[name]) == 1 and all(name in {n for _, n, _ in p} for _, p in parsed):
                    continue
                pair = f"{pair.partition('=')[0]}={_hashed(value)}"
            kept.append(pair)
        names.append(base + (f"?{'&'.join(kept)}" if kept else ""))
    return names


def same_objects(urls: Sequence[str]) -> list[str]:
    """What tells ``urls`` apart, for a digest that must not change while they name the same
    objects: each URL less its user info, signatures and signing fields, and the credential
    parameters that are the same on every URL (a presigned URL signed again is the same
    object; see :func:`_what_they_name`), and less the part all of them share up to the parent
    of their shared folder: that folder's own name is kept, so the same files at another
    mount, bucket or mirror (``/scratch/JOB/train/x``, ``/data/train/x``) are the same
    objects, and ``train/x`` and ``val/x`` are not."""
    names = _what_they_name(urls)
    if not names:
        return names
    shared = os.path.commonprefix(names)  # noqa: RUF071 (by characters, cut at a "/" below)
    folder_end = shared.rfind("/")
    cut = shared.rfind("/", 0, folder_end) + 1 if folder_end > 0 else 0
    return [name[cut:] for name in names]


def redact(text: str) -> str:
    """``text`` with every secret of the URLs in it masked (see the module docstring).

    Cheap where there is nothing to mask (two scans for ``@`` and ``=``), so it may be applied
    to every message.
    """
    if "@" in text:
        text = _LOOSE_USERINFO.sub(_loose_userinfo, text)
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _PARAMETER.sub(_parameter, text)
    return text


# -- exceptions ----------------------------------------------------------------------------

#: Links of a chain looked at: a chain is short; a cycle must not hang.
CHAIN_LIMIT = 32


class MaskedError(Exception):
    """Stands in an exception chain for another library's exception whose text named a
    secret: its type's name and its text, masked; its traceback, notes, cause and context
    kept (masked alike)."""


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ prints as such in a traceback too
        return ""
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        text = "\n".join([text, *(note for note in notes if isinstance(note, str))])
    return text


def _mask_in_place(exc: BaseException) -> None:
    """Mask the strings an exception keeps its text in: ``args``, an ``OSError``'s file names
    and message, the notes."""
    if any(isinstance(arg, str) for arg in exc.args):
        exc.args = tuple(redact(arg) if isinstance(arg, str) else arg for arg in exc.args)
    if isinstance(exc, OSError):
        for field in ("filename", "filename2", "strerror"):
            value = getattr(exc, field, None)
            if isinstance(value, str):
                setattr(exc, field, redact(value))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [redact(note) if isinstance(note, str) else note for note in notes]


#: Attributes through which another library's exception keeps the request it failed: its
#: headers (``Authorization``, cookies, keys) show in the exception's ``repr``, and no URL rule
#: can tell a header's value is a secret (aiohttp's ``ClientResponseError.request_info``,
#: ``TooManyRedirects.history``). An exception that has one is always replaced.
REQUEST_ATTRIBUTES = ("request_info", "history", "request")


def _has_request(exc: BaseException) -> bool:
    """Whether ``exc`` keeps a request: an attribute that fails to read counts as one
    (httpx's ``.request`` raises while unset), never a failure of its own."""
    for name in REQUEST_ATTRIBUTES:
        try:
            if getattr(exc, name, None) is not None:
                return True
        except Exception:
            return True
    return False


def _shown_text(exc: BaseException) -> str | None:
    """``str(exc)``, or None where it raises."""
    try:
        return str(exc)
    except Exception:
        return None


def text_of(exc: BaseException) -> str:
    """``str(exc)``, or ``<str() failed>`` where its ``__str__`` raises (what is shown of an
    error must never fail in its place)."""
    text = _shown_text(exc)
    return "<str() failed>" if text is None else text


def _leaks(exc: BaseException) -> bool:
    """Whether ``exc`` shows, or keeps where ``repr`` shows it, what must not be shown. What
    cannot be read (an attribute or ``__str__`` that raises) counts as shown: its stand-in
    says so instead."""
    if _has_request(exc) or _shown_text(exc) is None:
        return True
    text = _text(exc)
    try:
        shown = repr(exc)
    except Exception:  # a broken __repr__ shows nothing
        shown = ""
    return redact(text) != text or redact(shown) != shown


def _stand_in(exc: BaseException) -> MaskedError:
    kind = type(exc)
    notes = getattr(exc, "__notes__", None)
    stand = MaskedError(f"{kind.__module__}.{kind.__qualname__}: {redact(text_of(exc))}")
    stand.__traceback__ = exc.__traceback__
    stand.__cause__ = exc.__cause__
    stand.__context__ = exc.__context__
    stand.__suppress_context__ = exc.__suppress_context__
    for note in notes if isinstance(notes, list) else ():
        if isinstance(note, str):
            stand.add_note(redact(note))
    return stand


def masked(exc: BaseException) -> BaseException:
    """``exc`` with the secrets masked in everything a traceback prints of it: its text, its
    notes, and the whole chain of its causes and contexts.

    Arguments are masked in place; a link of the chain whose text still names a secret (a
    type that formats its attributes) is replaced by a :class:`MaskedError`. Returns ``exc``,
    or, where ``exc`` itself is such a type, its stand-in (raise what this returns).
    """
    _mask_in_place(exc)
    top = _stand_in(exc) if _leaks(exc) else exc
    # What each link seen became (itself, or its stand-in): one exception is often both the
    # cause and the context of the next ("raise ours from exc" in an except clause), and
    # both references must lead to the stand-in.
    shown: dict[int, BaseException] = {id(exc): top}
    links = [top]
    while links and len(shown) < CHAIN_LIMIT:
        link = links.pop()
        for field in ("__cause__", "__context__"):
            other = getattr(link, field)
            if other is None:
                continue
            seen = shown.get(id(other))
            if seen is None:
                _mask_in_place(other)
                seen = _stand_in(other) if _leaks(other) else other
                shown[id(other)] = seen
                links.append(seen)
            if seen is not other:
                suppress = link.__suppress_context__  # setting __cause__ sets it
                setattr(link, field, seen)
                link.__suppress_context__ = suppress
    return top
