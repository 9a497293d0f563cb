"""Exceptions of the kvtier package: one per status code a caller acts on.

Every failure of the C API raises KvtierError or a subclass, carrying the
status code (absl::StatusCode numbering, as the daemon's gRPC codes) and the
one-line reason. A cache miss is NotFound: `except kvtier.NotFound` is how a
caller tells a miss from a failure.
"""
from __future__ import annotations


class KvtierError(Exception):
    """A failed kvtier call: `.code` (int status code), `.reason` (one line)."""

    code_name = "UNKNOWN"

    def __init__(self, code: int, reason: str):
        super().__init__(f"{_CODE_NAMES.get(code, str(code))}: {reason}")
        self.code = code
        self.reason = reason


class InvalidArgument(KvtierError, ValueError):
    """Bad input: a malformed key, chunk, shape or option (code 3)."""


class NotFound(KvtierError, KeyError):
    """A cache miss, or a file that does not exist (code 5)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return Exception.__str__(self)


class AlreadyExists(KvtierError):
    """Code 6."""


class PermissionDenied(KvtierError, PermissionError):
    """Code 7."""


class ResourceExhausted(KvtierError):
    """The daemon's pool or a quota is full (code 8)."""


class FailedPrecondition(KvtierError):
    """The call needs something the daemon or client lacks (code 9)."""


class DeadlineExceeded(KvtierError, TimeoutError):
    """Code 4."""


class Unavailable(KvtierError, ConnectionError):
    """The daemon cannot be reached or went away (code 14)."""


class DataLoss(KvtierError):
    """A chunk failed its checksums; the daemon dropped it (code 15)."""


class Unauthenticated(KvtierError, PermissionError):
    """Missing or wrong token (code 16)."""


_CODE_NAMES = {
    1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}

_BY_CODE = {
    3: InvalidArgument, 4: DeadlineExceeded, 5: NotFound, 6: AlreadyExists,
    7: PermissionDenied, 8: ResourceExhausted, 9: FailedPrecondition, 14: Unavailable,
    15: DataLoss, 16: Unauthenticated,
}


def error_for(code: int, reason: str) -> KvtierError:
    return _BY_CODE.get(code, KvtierError)(code, reason)
