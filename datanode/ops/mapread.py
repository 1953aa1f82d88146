"""MAP_READ: the cluster map's ``parts/`` entries as this node holds them (datanode/mapcopy.py), for clients
that follow the map from a node instead of etcd.  A long poll: asked from a revision the copy has reached, the
answer waits (at most the request's ``arg`` ms, and ``mapcopy.WAIT_MAX_S``) for a change after it."""
from __future__ import annotations

from wire.protocol import Header, Op, Result
from ..mapcopy import PAGE_BYTES, MapCopy
from .base import Handler, Reply, Request
from .buffers import Buffers
from .wrap import Serving


class MapOps:
    def __init__(self, copy: MapCopy | None, buffers: Buffers, serving: Serving):
        self.copy = copy           # None: no etcd configured, no map here
        self.buffers = buffers
        self.serving = serving

    def handlers(self) -> dict[Op, Handler]:
        return {Op.MAP_READ: self.map_read}

    async def map_read(self, rq: Request) -> Header:
        h, copy = rq.h, self.copy
        if copy is None:
            raise Reply(Result.NOT_FOUND, why="this node keeps no cluster map (it has no etcd configured)")
        if copy.ready and h.arg and not self.serving.draining:
            await copy.wait_past(h.offset, h.arg / 1000)
        # entries travel as JSON strings inside JSON (their quotes escaped): a page of a third of the buffer fits
        return await self.buffers.push_bytes(rq.conn, h, copy.answer(h.offset, page=min(PAGE_BYTES, h.rlen // 3)))
