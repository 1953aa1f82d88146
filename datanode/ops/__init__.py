"""What the datanode does with a request; ``datanode.server.Node`` builds these parts and hands them over.

* ``wrap``       -- every request's way through the node: arrival and the handler (operate), between
                   ``admit`` (prepare: what the node refuses before any handler runs) and ``answer``
                   (post: the answer sent, the request counted).
* ``pipeline``   -- every replicated operation (append, create, delete, truncate), leader and follower: the
                   role, the forwards, the local step, the followers' acks, in one place.
* ``append``     -- WRITE, leader and follower (follow a write here); ``run``: a run of appends as one.
* ``data``       -- READ, CREATE_EXTENT, MARK_DELETE, WATERMARKS, PING.
* ``admin``      -- partitions (create, update, delete, list), node and pool status, health, repair/scrub
                   requests, the trash.
* ``repair``     -- the follower's side of the leader's repair and scrub: REPLICA_STATE, BLOCK_CRCS,
                   SCRUB_EXTENT, TRUNCATE.
* what handlers use: ``base`` (``Request``, ``Reply``, the store off the event loop), ``partitions`` (the
  request's partition, leadership, view changes), ``buffers`` (pool blocks, one-sided ops, JSON), ``stages``
  (the step recorder).
"""
