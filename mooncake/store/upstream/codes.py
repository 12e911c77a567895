"""Upstream Mooncake Store's integer return codes, and the rule that turns our outcomes
(result statuses, exceptions) into them.

The values are upstream's `ErrorCode` (mooncake-store/include/types.h in kvcache-ai/Mooncake,
tabled in docs/source/troubleshooting/error-code.md): 0 is success, every error negative.
"""

from __future__ import annotations

import enum

from mooncake.errors import MooncakeError, RpcError, StoreError, TransferError
from mooncake.store.client.client import NotFoundError, StatusError


class ErrorCode(enum.IntEnum):
    """The codes this drop-in returns (a subset of upstream's table)."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200  # no room in the pool for the value
    INVALID_KEY = -400
    INVALID_PARAMS = -600  # a bad argument (size, pointer, option), or not set up
    REPLICA_IS_NOT_READY = -703  # the object is being written or moved
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706  # a reader's lease protects it (remove): retry after the lease
    TRANSFER_FAIL = -800  # moving the bytes failed
    RPC_FAIL = -900  # the master did not answer


# our result status -> upstream's code
_STATUS_CODES = {
    "ok": ErrorCode.OK,
    "not_found": ErrorCode.OBJECT_NOT_FOUND,
    "exists": ErrorCode.OBJECT_ALREADY_EXISTS,
    "no_space": ErrorCode.NO_AVAILABLE_HANDLE,
    "busy": ErrorCode.REPLICA_IS_NOT_READY,
    "leased": ErrorCode.OBJECT_HAS_LEASE,
    "error": ErrorCode.INVALID_PARAMS,
}


def code_of_status(status: str) -> int:
    """The code of one of our result statuses (store/metadata/objects.py `Status`)."""
    return int(_STATUS_CODES.get(status, ErrorCode.INTERNAL_ERROR))


def code_of_put(status: str) -> int:
    """A put's code: upstream's client counts a key that already exists, or that another
    writer is writing, as stored (client_service.cpp, Put and BatchPut)."""
    return 0 if status in ("exists", "busy") else code_of_status(status)


def code_of(e: MooncakeError) -> int:
    """The code of an exception our Store raised: a miss, a refused key (its status), the
    master unreachable, the bytes not moved."""
    if isinstance(e, NotFoundError):
        return int(ErrorCode.OBJECT_NOT_FOUND)
    if isinstance(e, StatusError):
        return code_of_status(e.status)
    if isinstance(e, RpcError) or isinstance(e.__cause__, RpcError):
        return int(ErrorCode.RPC_FAIL)
    if isinstance(e, StoreError | TransferError):
        return int(ErrorCode.TRANSFER_FAIL)
    return int(ErrorCode.INTERNAL_ERROR)
