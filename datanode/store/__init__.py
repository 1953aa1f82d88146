"""The on-disk extent store of one data partition.

Layout (under the store's ``root``)::

    next_extent_id          decimal, the next id create_extent(None) hands out (atomic replace)
    extents/<id>.dat        extent data, append-only, at most MAX_EXTENT bytes
    extents/<id>.crc        one 8-byte entry per 128 KiB block, then two tail slots (crcfile.py)
    extents/<id>.deleted    tombstone of a deleted extent (emptied in steps: ``free_in_steps``); the id is never
                            handed out again

Who owns what: crcfile.py the CRC file's format and the block-CRC arithmetic (pure); flush.py the write
order and how an append becomes durable (one flush, zero-fill ahead); recovery.py what an open keeps of
each extent; direct.py how bytes move between the data file and the caller (O_DIRECT or the page cache);
extent.py one open extent and its locks; files.py the file calls under them all; extent_store.py
``ExtentStore``, the API the node calls; options.py the node's settings for it.
"""
from wire.protocol import MAX_EXTENT

from .crcfile import BLOCK, SLOT_SIZE, piece_crcs
from .direct import cached_pages
from .errors import StoreCode, StoreError, WouldBlock, io_error
from .extent_store import MAX_EXTENT_ID, ExtentStore
from .files import free_in_steps, shrink_in_steps
from .options import StoreOptions

__all__ = ["BLOCK", "MAX_EXTENT", "MAX_EXTENT_ID", "SLOT_SIZE", "ExtentStore", "StoreCode", "StoreError",
           "StoreOptions", "WouldBlock", "cached_pages", "free_in_steps", "io_error", "piece_crcs",
           "shrink_in_steps"]
