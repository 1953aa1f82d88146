"""``dnfs fsck``: the metadata checked against itself and against the datanodes.

Checks: entries pointing at missing inodes, link counts, inodes with no links (a crash between the last
unlink and the last close), overlapping slices; every slice's extent exists on the partition's leader and
is long enough for the piece the slice was cut from; the CRC32C of every written piece read back matches the
one recorded at write time (``--no-crc`` skips the reads); extents the filesystem wrote that no slice
references any more; the deletion queue's length.

``--repair`` does only what is safe: removes dangling entries and orphan inodes, fixes link counts, queues
unreferenced extents and works the deletion queue.  Slices whose data is missing are reported, never
dropped (that would silently turn lost data into zeros).
"""
from __future__ import annotations

import logging

from client.fs.meta import Meta
from client.fs.reclaim import Reclaimer
from client.sdk import ClientError, DataClient
from wire.crc import crc32c

log = logging.getLogger(__name__)


async def fsck(meta: Meta, dc: DataClient, *, repair: bool = False, verify_crc: bool = True) -> dict:
    problems = await meta.check()
    slices = await meta.all_slices()
    inline = [(ino, s) for ino, s in slices if s.inline]      # bytes in the metadata: no extent to check
    slices = [(ino, s) for ino, s in slices if not s.inline]
    marks: dict[int, dict[int, int]] = {}
    for pid in sorted({s.partition for _, s in slices}):
        marks[pid] = await dc.watermarks(pid)
    pieces = {}
    referenced = set()
    for ino, s in slices:
        referenced.add((s.partition, s.extent))
        size = marks.get(s.partition, {}).get(s.extent)
        if size is None:
            problems.append({"kind": "missing_extent", "ino": ino, "off": s.off, "partition": s.partition,
                             "extent": s.extent})
        elif size < s.wpos + s.wlen or not (s.wpos <= s.ext_off and s.ext_off + s.length <= s.wpos + s.wlen):
            problems.append({"kind": "short_extent", "ino": ino, "off": s.off, "partition": s.partition,
                             "extent": s.extent, "extent_size": size, "needs": s.wpos + s.wlen})
        else:
            pieces.setdefault((s.partition, s.extent, s.wpos, s.wlen, s.crc), ino)
    checked = 0
    if verify_crc:
        for (pid, extent, wpos, wlen, crc), ino in sorted(pieces.items()):
            try:
                data = await dc.read(pid, extent, wpos, wlen)
            except ClientError as e:
                problems.append({"kind": "unreadable", "ino": ino, "partition": pid, "extent": extent,
                                 "offset": wpos, "error": str(e)})
                continue
            checked += 1
            if crc32c(data) != crc:
                problems.append({"kind": "crc_mismatch", "ino": ino, "partition": pid, "extent": extent,
                                 "offset": wpos, "length": wlen})
    for pid, extent in sorted(await meta.known_extents() - referenced):
        problems.append({"kind": "unreferenced_extent", "partition": pid, "extent": extent})
    queued = len(await meta.queued(1 << 30))
    report = {"slices": len(slices) + len(inline), "inline_slices": len(inline), "pieces_crc_checked": checked,
              "problems": problems, "deletion_queue": queued, "repaired": [], "extents_released": 0}
    if repair:
        meta.reclaim_all = True          # run while unmounted: every session's leftovers may go
        report["repaired"] = await meta.repair(problems)
        report["extents_released"] = await Reclaimer(meta, dc).drain()
        report["deletion_queue"] = len(await meta.queued(1 << 30))
    return report
