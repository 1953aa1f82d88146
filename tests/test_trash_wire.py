"""The trash over the wire: a running node lists, restores and purges its deleted partitions for an
admin (TRASH_LIST / TRASH_RESTORE / TRASH_PURGE, audit-logged), through the admin library and ``dnctl trash
... --node ADDR``; other roles get FORBIDDEN, bad bodies BAD_BODY, and a live partition is never clobbered."""
from __future__ import annotations

import json
import pathlib

import pytest
import trio

from client import admin
from client.sdk import ClientError
from wire.auth import Credentials, DialAuth
from wire.protocol import BODY_REASONS, Header, Op, Result, Role
from tests.conftest import create_partition, open_client, pattern, run
from tests.conftest import dnctl as conftest_dnctl
from tests.test_trust import secret  # noqa: F401 - the fixture (a cluster secret file, mode 0600)
from lab import fuzz

KiB = 1 << 10
PID = 7


def audit_lines(node) -> list[dict]:
    p = pathlib.Path(node.cfg["data_dir"]) / "audit.log"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def test_delete_list_restore_read_back_over_the_wire(nodes, secret):
    """A partition with data is deleted; an admin lists the trash over the wire, restores it on the running
    node, and reads back the same bytes; restoring again (the partition is live) is EXISTS, nothing changes."""
    [n] = nodes(1, secret_file=str(secret))
    data = pattern(11, 700 * KiB)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            locs = await adm.write(PID, data)
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
            assert PID not in (await admin.node_status(adm, n.addr))["partitions"]
            listing = await admin.trash_list(adm, n.addr)
            assert [e["partition"] for e in listing] == [PID]
            e = listing[0]
            assert e["bytes"] >= len(data) and 0 < e["purge_in_s"] <= 86400
            assert await admin.trash_restore(adm, n.addr, e["name"]) == PID
            assert await admin.trash_list(adm, n.addr) == []
            assert PID in (await admin.node_status(adm, n.addr))["partitions"]
            await adm.discover(n.addr)
            assert b"".join([await adm.read_location(loc) for loc in locs]) == data
            more = pattern(12, 10 * KiB)                # and it takes writes again
            loc2 = await adm.write(PID, more)
            assert b"".join([await adm.read_location(loc) for loc in loc2]) == more

            # delete again, then make a new partition with the same id: restoring the old one must not clobber it
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
            [old] = await admin.trash_list(adm, n.addr)
            fresh = pattern(13, 5 * KiB)
            async with open_client("tcp", [], secret=str(secret)) as adm2:   # (adm would append to its old extent)
                await create_partition(adm2, PID, [n.addr])
                floc = await adm2.write(PID, fresh)
            with pytest.raises(ClientError, match=f"partition {PID} is live there") as ei:
                await admin.trash_restore(adm, n.addr, old["name"])
            assert ei.value.result == Result.EXISTS
            assert [x["name"] for x in await admin.trash_list(adm, n.addr)] == [old["name"]]   # still in the trash
            assert b"".join([await adm.read_location(loc) for loc in floc]) == fresh          # live copy untouched
            with pytest.raises(ClientError) as ei:
                await admin.trash_restore(adm, n.addr, "7.123")
            assert ei.value.result == Result.NOT_FOUND

            # purge: a name it lacks refuses the whole request; then the real one
            with pytest.raises(ClientError) as ei:
                await admin.trash_purge(adm, n.addr, names=[old["name"], "7.1"])
            assert ei.value.result == Result.NOT_FOUND
            gone = await admin.trash_purge(adm, n.addr, names=[old["name"]])
            assert [g["name"] for g in gone] == [old["name"]]
            assert await admin.trash_list(adm, n.addr) == []
            return old["name"]
    name = run(body)
    log = [(a["op"], a["result"], a["detail"]) for a in audit_lines(n) if a["op"].startswith("TRASH_")]
    assert ("TRASH_LIST", "OK", "") in log
    assert any(op == "TRASH_RESTORE" and r == "OK" and f"as partition {PID}" in d for op, r, d in log), log
    assert any(op == "TRASH_RESTORE" and r == "EXISTS" and "is live" in d for op, r, d in log), log
    assert any(op == "TRASH_PURGE" and r == "CONFIRM" and "needs confirmation" in d for op, r, d in log), log
    assert ("TRASH_PURGE", "OK", f"purged (names, confirmed): {name}") in log
    assert "Traceback" not in n.log_path.read_text()


def test_trash_ops_need_the_admin_role_and_a_whole_valid_body(nodes, secret):
    [n] = nodes(1, secret_file=str(secret))

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            await adm.write(PID, b"x" * 1000)
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
            [entry] = await admin.trash_list(adm, n.addr)
        async with open_client("tcp", [], secret=str(secret), role="client") as dc:
            for call in (admin.trash_list(dc, n.addr), admin.trash_restore(dc, n.addr, entry["name"]),
                         admin.trash_purge(dc, n.addr, names=[entry["name"]])):
                with pytest.raises(ClientError) as ei:
                    await call
                assert ei.value.result == Result.FORBIDDEN
        as_node = DialAuth(Credentials.load(secret), Role.NODE, identity=n.addr)     # even the node itself
        for op, b in ((Op.TRASH_LIST, b""), (Op.TRASH_RESTORE, json.dumps({"name": entry["name"]}).encode()),
                      (Op.TRASH_PURGE, b'{"all": true}')):
            h = Header(opcode=op, length=len(b), addr=0x10000, rkey=5, rlen=max(len(b), 4096), req_id=1)
            r = await trio.to_thread.run_sync(lambda: fuzz.request(n.addr, h, b, auth=as_node))
            assert r.result == Result.FORBIDDEN, op
        async with open_client("tcp", [], secret=str(secret)) as adm:
            bad = [(Op.TRASH_RESTORE, {"name": "../../etc"}, "bad_trash_name"),
                   (Op.TRASH_RESTORE, {"name": 7}, "bad_trash_name"),
                   (Op.TRASH_RESTORE, {}, "bad_trash_name"),
                   (Op.TRASH_RESTORE, {"name": entry["name"], "force": True}, "unknown_key"),
                   (Op.TRASH_RESTORE, [entry["name"]], "not_an_object"),
                   (Op.TRASH_PURGE, {}, "purge_choice"),
                   (Op.TRASH_PURGE, {"all": True, "expired": True}, "purge_choice"),
                   (Op.TRASH_PURGE, {"all": 1}, "purge_choice"),
                   (Op.TRASH_PURGE, {"names": []}, "purge_choice"),
                   (Op.TRASH_PURGE, {"names": [entry["name"], "x/y"]}, "bad_trash_name"),
                   (Op.TRASH_PURGE, {"names": "7.1"}, "purge_choice")]
            for op, b, reason in bad:
                resp, _ = await adm.request(n.addr, Header(opcode=op), body=json.dumps(b).encode())
                assert resp.result == Result.BAD_BODY and BODY_REASONS[resp.arg] == reason, (b, resp)
            resp, _ = await adm.request(n.addr, Header(opcode=Op.TRASH_PURGE), body=b"{not json")
            assert resp.result == Result.BAD_BODY and BODY_REASONS[resp.arg] == "not_json"
            assert [e["name"] for e in await admin.trash_list(adm, n.addr)] == [entry["name"]]   # nothing changed
    run(body)
    forbidden = [a for a in audit_lines(n) if a["op"].startswith("TRASH_") and a["result"] == "FORBIDDEN"]
    assert {a["role"] for a in forbidden} == {"client", "node"} and len(forbidden) == 6


def test_a_purge_needs_its_confirmation_token(nodes, secret):
    """TRASH_PURGE alone purges nothing: the node answers CONFIRM with a token for exactly what it would purge
    and for that asker; only the same request with that token purges, once.  A token of another request or a
    made-up one gets a new CONFIRM, and the entries stay."""
    [n] = nodes(1, secret_file=str(secret))

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            for pid in (PID, PID + 1):
                await create_partition(adm, pid, [n.addr])
                await adm.write(pid, b"y" * 5000)
                await adm.admin(n.addr, Op.PARTITION_DELETE, partition=pid)
            names = sorted(e["name"] for e in await admin.trash_list(adm, n.addr))

            async def purge(b):
                resp, _ = await adm.request(n.addr, Header(opcode=Op.TRASH_PURGE), body=json.dumps(b).encode())
                return resp
            r = await purge({"all": True})                      # blind: nothing purged, a token given
            assert r.result == Result.CONFIRM and r.arg
            token = f"{r.arg:016x}"
            assert sorted(e["name"] for e in await admin.trash_list(adm, n.addr)) == names
            for b in ({"names": names[:1], "token": token},      # another request
                      {"all": True, "token": f"{(r.arg ^ 1):016x}"}):   # a made-up token
                again = await purge(b)
                assert again.result == Result.CONFIRM and again.arg not in (0, r.arg)
            assert sorted(e["name"] for e in await admin.trash_list(adm, n.addr)) == names
            r2 = await purge({"all": True, "token": token})
            assert r2.result == Result.OK and r2.arg == len(names)
            assert await admin.trash_list(adm, n.addr) == []
            r3 = await purge({"all": True, "token": token})    # used up (and nothing left to purge)
            assert r3.result == Result.OK and r3.arg == 0
    run(body)


def test_dnctl_trash_over_the_wire(nodes, secret, tmp_path):
    """``dnctl trash list|restore|purge --node ADDR`` on a running node, with --json and clear errors."""
    [n] = nodes(1, secret_file=str(secret))
    data = pattern(14, 300 * KiB)

    async def write():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            locs = await adm.write(PID, data)
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
            return locs
    locs = run(write)

    def dnctl(*args, secret_file=secret):
        pre = ["--secret-file", str(secret_file)] if secret_file else []
        return conftest_dnctl(*pre, "trash", *args, timeout=60)
    p = dnctl("list", "--node", n.addr, "--json")
    assert p.returncode == 0, p.stderr
    [row] = json.loads(p.stdout)
    assert row["partition"] == PID and row["node"] == n.addr and row["via"] == "node"
    p = dnctl("list", "--node", n.addr)
    assert row["name"] in p.stdout and f"partition {PID}" in p.stdout
    p = dnctl("restore", "not-a-name", "--node", n.addr)
    assert p.returncode == 2 and "PARTITION.NANOSECONDS" in p.stderr and "bad_trash_name" not in p.stderr and "Traceback" not in p.stderr
    p = dnctl("list", "--node", n.addr, secret_file=None)
    assert p.returncode == 1 and "requires authentication" in p.stderr and "Traceback" not in p.stderr
    p = dnctl("restore", row["name"], "--node", n.addr, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"node": n.addr, "name": row["name"], "partition": PID, "via": "node"}

    async def read():
        async with open_client("tcp", [n.addr], secret=str(secret)) as dc:
            return b"".join([await dc.read_location(loc) for loc in locs])
    assert run(read) == data
    p = dnctl("purge", "--all", "--node", n.addr, "--json")
    assert p.returncode == 0 and json.loads(p.stdout) == [], p.stderr

    async def delete_again():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
    run(delete_again)
    p = dnctl("purge", "--all", "--node", n.addr)              # no terminal to ask on, no --yes
    assert p.returncode == 2 and "--yes" in p.stderr and "Traceback" not in p.stderr
    p = dnctl("list", "--node", n.addr, "--json")
    assert [r["partition"] for r in json.loads(p.stdout)] == [PID]      # nothing purged
    p = dnctl("purge", "--all", "--node", n.addr, "--yes", "--json")
    assert p.returncode == 0, p.stderr
    assert [(g["node"], g["via"]) for g in json.loads(p.stdout)] == [(n.addr, "node")]
    assert json.loads(dnctl("list", "--node", n.addr, "--json").stdout) == []
    p = dnctl("purge", "7.5", "--node", n.addr)
    assert p.returncode == 1 and "no trash entry 7.5" in p.stderr


def test_a_restore_waits_for_a_purge_in_progress_and_never_gets_a_half_deleted_partition(tmp_path, monkeypatch):
    """A purge removes a trash entry file by file; a restore of that entry arriving meanwhile must not rename
    it back into service half-deleted (rmtree works through the open directory and would go on deleting the
    restored partition's files): it waits, and then finds the entry gone."""
    import shutil
    import threading

    from datanode import partition as partition_mod
    from datanode.partition import PartitionTable

    table = PartitionTable(tmp_path / "data", "none")
    part = table.create(7, ["127.0.0.1:1"], 1)
    eid = part.store.create_extent()
    part.store.write(eid, 0, b"x" * 65536)
    name = table.delete(7).name
    started, go_on = threading.Event(), threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path, *a, **kw):          # a big entry: the purge is still at it when the restore comes
        started.set()
        go_on.wait(10)
        return real_rmtree(path, *a, **kw)
    monkeypatch.setattr(partition_mod.shutil, "rmtree", slow_rmtree)
    outcome = {}

    def purge():
        outcome["purged"] = table.purge_names([name])

    def restore():
        try:
            outcome["restored"] = table.restore_live(name)
        except FileNotFoundError as e:
            outcome["restore_error"] = e

    t1 = threading.Thread(target=purge)
    t1.start()
    assert started.wait(10)
    t2 = threading.Thread(target=restore)
    t2.start()
    t2.join(0.5)
    assert t2.is_alive(), "the restore went ahead while the purge was removing the entry"
    go_on.set()
    t1.join(10)
    t2.join(10)
    assert [e["name"] for e in outcome["purged"]] == [name]
    assert "restore_error" in outcome and "restored" not in outcome
    assert table.get(7) is None and not (tmp_path / "data" / "partitions" / "7").exists()
    table.close()
