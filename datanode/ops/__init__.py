"""The datanode's request handlers, grouped by concern; ``datanode.server.Node`` combines them.

* ``base``   -- what every handler uses: the request's partition, pool blocks, one-sided ops bounded in time,
               the store off the event loop, JSON bodies and answers, and ``Reply`` (one result code each).
* ``data``   -- the data path: WRITE (follow a write here), READ, CREATE_EXTENT, MARK_DELETE, WATERMARKS, PING.
* ``admin``  -- partitions (create, update, delete, list), node and pool status, health, repair/scrub requests.
* ``repair`` -- the follower's side of the leader's repair and scrub: REPLICA_STATE, BLOCK_CRCS,
               SCRUB_EXTENT, TRUNCATE.
"""
