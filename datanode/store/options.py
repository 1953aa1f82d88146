"""How a store writes, reads and frees space: the node's config keys of the same names (datanode/config.py
says when to change each), given to every ``ExtentStore`` it opens."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .files import FREE_STEP

if TYPE_CHECKING:
    from ..config import StoreConfig


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    one_flush: bool = True             # one fdatasync per durable flush where that is safe (flush.py)
    free_step_bytes: int = FREE_STEP   # a delete or big truncate frees this much per fsync (0: at once)
    prefill_bytes: int = 256 << 10     # small durable appends zero-fill the data file this far ahead (0: off)
    direct_reads: bool = True          # big cold aligned reads with O_DIRECT (direct.py)
    direct_writes: bool = True         # big aligned appends with O_DIRECT (direct.py)

    @classmethod
    def from_config(cls, cfg: "StoreConfig") -> "StoreOptions":
        """The options a node's config sets (its store section's keys have these names)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})
