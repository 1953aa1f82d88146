"""Switching a running cluster without a secret to one (docs/security.md, "Switching a running cluster to a
secret"): restart each node with ``secret_file`` and ``auth_transition = true``, move the clients to the
secret, restart each node again without ``auth_transition``.  Real nodes; writes go on at every step, every
acknowledged byte reads back from every replica after each restart, and at the end a peer without the secret
is refused at the hello."""
from __future__ import annotations

from functools import partial

import pytest

from client import admin
from client.sdk import ClientError
from lab import fuzz
from tests.conftest import create_partition, open_client, pattern, run
from tests.test_trust import secret  # noqa: F401 - the fixture (a cluster secret file, mode 0600)
from wire.protocol import Header, Op

KiB = 1 << 10
PID = 9


def test_a_rolling_switch_to_the_secret_loses_nothing_and_locks_out_the_rest(nodes, secret):
    ns = nodes(3, heartbeat_s=0.3)
    replicas = [n.addr for n in ns]
    written: list[tuple[list, bytes]] = []

    async def write_and_check(step: str, **client_kw) -> None:
        async with open_client("tcp", [], **client_kw) as dc:
            if not written:
                await create_partition(dc, PID, replicas)
            await dc.discover(replicas[0])
            data = pattern(len(written), 300 * KiB)
            written.append((await dc.write(PID, data), data))
            await admin.wait_settled(dc, replicas[0], PID, timeout=30)
            for r in replicas:
                for locs, want in written:
                    got = b"".join([await dc.read_location(loc, replica=r) for loc in locs])
                    assert got == want, f"{step}: piece {written.index((locs, want))} differs on {r}"

    def restart(n, **cfg) -> None:
        n.stop()
        n.cfg.update(cfg)
        for k in [k for k, v in cfg.items() if v is None]:
            del n.cfg[k]
        n.start()

    run(write_and_check, "before")
    for n in ns:                                  # 1. the secret, and still peers without it
        restart(n, secret_file=str(secret), auth_transition=True)
        run(write_and_check, f"{n.addr} in transition")
    run(partial(write_and_check, "clients with the secret", secret=str(secret)))    # 2. the clients move
    for n in ns:                                  # 3. the secret only
        restart(n, auth_transition=None)
        run(partial(write_and_check, f"{n.addr} with the secret only", secret=str(secret)))

    async def plain():
        async with open_client("tcp", []) as dc:
            await dc.admin(replicas[0], Op.NODE_STATUS)
    with pytest.raises(ClientError, match="requires authentication"):
        run(plain)
    for r in replicas:                            # a raw peer without the secret: refused at the hello
        with pytest.raises(fuzz.Refused, match="authentication required"):
            fuzz.request(r, Header(opcode=Op.PING, req_id=1))

    async def status():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            return [await admin.node_status(dc, r) for r in replicas]
    for st in run(status):
        assert st["auth"] == "on" and st["peers"] == "those holding the secret"
