"""oxccl's exceptions. Every error of the library is an ``oxccl.Error``."""

import builtins


class Error(RuntimeError):
    """Base class of every oxccl error (a ``RuntimeError``)."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberately shadows
    """A call did not complete within the communicator's timeout (``OXCCL_TIMEOUT``)."""


class PeerLostError(Error, ConnectionError):
    """A peer rank went away (exited, was killed, connection reset) or was unreachable."""


class MismatchError(Error):
    """Ranks made different calls, or the same call with different arguments."""


class InvalidArgumentError(Error, ValueError):
    """A call that cannot work: wrong length, dtype, layout, root, peer, ..."""


class AbortedError(Error):
    """The communicator failed earlier (or was aborted) and can no longer be used."""


#: The class of each result code of the C ABI (``oxcclResult_t`` in ``oxccl.h``): the native
#: module and the C++ torch backend raise through :func:`for_result`.
_BY_RESULT = {
    1: InvalidArgumentError,  # oxcclInvalidArgument
    2: TimeoutError,  # oxcclTimeout
    3: PeerLostError,  # oxcclPeerLost
    4: MismatchError,  # oxcclMismatch
    5: AbortedError,  # oxcclAborted
}


def for_result(code: int) -> type:
    """The exception class of a C ABI result code (``Error`` for the others)."""
    return _BY_RESULT.get(code, Error)


__all__ = [
    "Error",
    "TimeoutError",
    "PeerLostError",
    "MismatchError",
    "InvalidArgumentError",
    "AbortedError",
]
