"""Errors as stored data: the JSON document a failure is recorded as (so a process that
never saw the exception can match it by type), the error rebuilt from it at replay, and the
one-line forms logs use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

#: The most bits of an integer a message spells out (Python refuses to turn one of more
#: than 4,300 digits into text).
_SHOWN_BITS: Final = 10_000


def text_of(value: object) -> str:
    """``str(value)``, or a stand-in when it cannot be had (a ``__str__`` that raises, an
    integer too long to print, a structure too deep): an error must always be recordable.
    Only ``type()`` is asked of the value before (its ``__class__`` may raise too)."""
    try:
        return str.__str__(_too_long(value) or str(value))
    except Exception:
        return f"<a {_type_name(value)} that cannot be shown as text>"


def shown(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters, for a message about a bad argument; a
    value whose repr cannot be had is named by its type."""
    try:
        return str.__str__(_too_long(value) or repr(value))[:width]
    except Exception:
        return f"<a {_type_name(value)}>"


def _too_long(value: object) -> str | None:
    if issubclass(type(value), int):
        bits = int.bit_length(value)  # type: ignore[arg-type]
        if bits > _SHOWN_BITS:
            return f"<an integer of {bits} bits>"
    return None


def _type_name(value: object) -> str:
    try:
        return str.__str__(type.__dict__["__name__"].__get__(type(value)))
    except Exception:
        return "value"


def error_document(
    exc: BaseException, redact: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """A JSON document for a stored error: its type name, message and JSON-able fields.

    Keeping the type name and fields (not only the message) lets callers match failures by
    type after they crossed the database, even in a process that never saw the exception.
    ``redact`` scrubs the traceback before it is cut (a secret cut in two would no longer
    be recognised by whoever scrubs the document afterwards).
    """
    import json

    from .values import unstorable

    def storable(value: Any) -> Any:
        """The value as strict JSON every backend keeps (no NaN, no integer beyond 64
        bits, not nested past MariaDB's limit), else its text: an error must always be
        recordable, or the step that raised it would run again at every drive."""
        try:
            dumped = json.dumps(value, allow_nan=False)
            doc = _scrub(json.loads(dumped))
        except (TypeError, ValueError, RecursionError):
            return _cut(text_of(value))
        # Room for the levels around it: event, error, compensation errors, args.
        if unstorable(doc, 6) or len(dumped) > MAX_VALUE:
            return _cut(text_of(value))
        return _cut(doc) if isinstance(doc, str) else doc

    doc: dict[str, Any] = {
        "name": type(exc).__name__,
        "module": type(exc).__module__,
        "message": _cut(text_of(exc)),
    }
    # Strict JSON (no NaN or infinities, which JSON columns reject), kept in its JSON form:
    # the document a caller gets is the one a later read of the database returns.
    doc["args"] = [storable(a) for a in exc.args]
    for key, value in vars(exc).items():
        if key.startswith("_") or key in doc:
            continue
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            continue  # not data (a connection, a callable): left out
        doc[key] = storable(value)
    trace = traceback_text(exc, redact)
    if trace is not None:
        doc["traceback"] = trace
    # An error must always be recordable: databases reject NUL and lone surrogates in text.
    cleaned: dict[str, Any] = _scrub(doc)
    return cleaned


#: The longest traceback kept in an error document (its end, where the error was raised).
MAX_TRACEBACK: Final = 8000
#: The longest message (and text of an argument or field) kept in an error document: an
#: error's document is nested in the run's and written more than once, and a message of
#: megabytes made every write of the failure too large, so the step ran again at every
#: drive until the run failed with ``DriveFailedError`` instead of its own error.
MAX_MESSAGE: Final = 8000
#: The longest JSON of another argument or field kept as it is (an error document of a
#: cause, nested, is one: each of its texts is cut already), else its text, cut.
MAX_VALUE: Final = 256 * 1024


def _cut(text: str) -> str:
    """``text``, its beginning only past :data:`MAX_MESSAGE` characters (saying so)."""
    if len(text) <= MAX_MESSAGE:
        return text
    return f"{text[:MAX_MESSAGE]}... ({len(text) - MAX_MESSAGE} more characters)"


def traceback_text(exc: BaseException, redact: Callable[[str], str] | None = None) -> str | None:
    """The formatted traceback of a raised exception (with its causes), passed through
    ``redact`` and then cut to its last :data:`MAX_TRACEBACK` characters; ``None`` for one
    never raised."""
    import traceback

    if exc.__traceback__ is None:
        return None
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # a __str__ that raises: the frames are still worth keeping
        text = "".join(traceback.format_tb(exc.__traceback__))
    if redact is not None:
        # Only the end is kept: the scrub's work is bounded by what may be kept, with room
        # for a secret that the final cut would leave in part.
        text = redact(text[-2 * MAX_TRACEBACK :])
    if len(text) > MAX_TRACEBACK:
        text = "...\n" + text[-MAX_TRACEBACK:]
    return text


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        text = value.replace("\x00", "\\0")
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def driver_error(exc: BaseException) -> BaseException:
    """The database driver's own error behind a SQLAlchemy wrapper (whose message repeats
    the whole statement), else ``exc`` itself."""
    from sqlalchemy.exc import DBAPIError

    if isinstance(exc, DBAPIError) and isinstance(exc.orig, BaseException):
        return exc.orig
    return exc


def brief(exc: BaseException) -> str:
    """One line for a log: the error's type and the first line of its message."""
    found = driver_error(exc)
    lines = text_of(found).strip().splitlines()
    return f"{type(found).__name__}: {lines[0] if lines else ''}"


def rebuild_error(cls: type[BaseException], doc: dict[str, Any]) -> BaseException:
    """An instance of ``cls`` carrying a recorded error's args and fields (for replay)."""
    exc = cls.__new__(cls)
    exc.args = tuple(doc.get("args") or [doc.get("message", "")])
    skip = {"name", "module", "message", "args"}
    for key, value in doc.items():
        if key not in skip:
            try:
                setattr(exc, key, value)
            except AttributeError:
                continue
    return exc
