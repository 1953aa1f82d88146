"""What the leader's repair (datanode/repair.py), its scrub (datanode/scrub.py) and the node's health prober
(datanode/health.py) share: the error that stops one follower's step, and the rate cap."""
from __future__ import annotations

import trio

from wire.protocol import Result

MiB = 1 << 20
JSON_ANSWER = 1 << 20     # the largest JSON answer taken from a peer
JSON_FIRST = 64 << 10     # the room first given to one (most are far smaller): a larger answer is asked again


class RepairAbort(Exception):
    """This follower (or extent) cannot be repaired right now; the next pass tries again."""


class RateLimiter:
    """A pacing bucket: ``take(n)`` returns when ``n`` more bytes fit under ``mib_s`` (0: no cap)."""

    def __init__(self, mib_s: float):
        self.rate = mib_s * MiB
        self._next = 0.0

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            await trio.lowlevel.checkpoint()
            return
        now = trio.current_time()
        start = max(now, self._next)
        self._next = start + n / self.rate
        await trio.sleep_until(start)


class Refused(RepairAbort):
    """The peer answered the request with an error (its result code is in the message)."""


class NotHosted(Refused):
    """The peer does not host the partition (or the extent)."""


def _name(result: int) -> str:
    try:
        return Result(result).name
    except ValueError:
        return hex(result)
