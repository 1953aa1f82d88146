"""What a store operation raises: StoreError with a StoreCode, or WouldBlock for a caller that must not wait."""
from __future__ import annotations

import enum
import errno


class StoreCode(enum.StrEnum):
    """Why a store operation failed: one code per condition (the server maps each to one result code)."""
    NOT_FOUND = "not_found"          # no such extent
    DELETED = "deleted"              # the extent was deleted (its id is never reused)
    EXISTS = "exists"                # create of an id that exists; arg = the id
    WRONG_OFFSET = "wrong_offset"    # an append not at the end; arg = the extent's end
    OUT_OF_RANGE = "out_of_range"    # a read/truncate beyond the end (or negative); arg = the extent's size
    TOO_LARGE = "too_large"          # the extent would exceed MAX_EXTENT; arg = MAX_EXTENT
    CRC = "crc"                      # bytes fail their CRC (a payload, or a stored block)
    NO_SPACE = "no_space"            # the file system is full (ENOSPC/EDQUOT)
    DISK = "disk"                    # any other I/O failure, a closed store, a broken extent


class WouldBlock(Exception):
    """An operation asked not to block would have: ``append(blocking=False)`` found the extent's mutation lock
    taken (a truncate, delete or close), or a ``nowait`` read found a truncate in progress or bytes not in
    the page cache."""


class StoreError(Exception):
    """``code`` is a StoreCode; ``arg`` what that code says it carries (else 0)."""

    def __init__(self, code: StoreCode, message: str, arg: int = 0):
        super().__init__(f"{code}: {message}")
        self.code = StoreCode(code)
        self.message = message
        self.arg = arg


def io_error(what: str, e: OSError) -> StoreError:
    """An OSError as a StoreError: a full disk is NO_SPACE, anything else DISK."""
    code = StoreCode.NO_SPACE if e.errno in (errno.ENOSPC, errno.EDQUOT) else StoreCode.DISK
    return StoreError(code, f"{what}: {e}")
