"""The cheaper read of FUSE requests (client/fs/fuseloop.py): pure trio on a pipe, then a real mount."""
from __future__ import annotations

import concurrent.futures
import json
import os

import pyfuse3
import pytest
import trio
import trio.testing

from client.fs import fuseloop
from tests.conftest import pattern
from tests.test_dnfs import Mount, cluster, dnfs  # noqa: F401 - the module-scoped cluster fixture


def test_a_waiting_request_is_read_at_once_yet_the_other_tasks_still_run():
    """A readable descriptor: wait_readable returns without a scheduler pass nearly every time, but lets the
    other tasks run once its turn (a millisecond) is over: a stream of requests cannot starve them."""
    r, w = os.pipe()
    os.write(w, b"x")
    reads = fuseloop.Reads()
    others = 0

    async def other():
        nonlocal others
        while True:
            await trio.sleep(0)
            others += 1

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(other)
            await trio.sleep(0)
            for _ in range(1_000_000):          # (bounded: a broken turn rule fails the asserts below)
                await reads.wait_readable(r)
                if reads.waited >= 10:
                    break
            n.cancel_scope.cancel()
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)
    assert reads.waited >= 10 and reads.at_once > 5 * reads.waited, reads.stats()
    assert others >= 5, f"the other task ran {others} times in {reads.waited} turns"


def test_an_idle_descriptor_is_waited_for():
    r, w = os.pipe()
    reads = fuseloop.Reads()
    woke = []

    async def main():
        async with trio.open_nursery() as n:
            async def reader():
                await reads.wait_readable(r)
                woke.append(trio.current_time())
            n.start_soon(reader)
            await trio.sleep(0.1)
            assert not woke, "wait_readable returned on an empty pipe"
            os.write(w, b"x")
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)
    assert woke and reads.stats() == {"at_once": 0, "waited": 1}


def test_the_read_lock_excludes_serves_in_order_and_survives_a_cancelled_waiter():
    lock = fuseloop.ReadLock()
    order = []

    async def main():
        with trio.testing.assert_no_checkpoints():       # free: taken and let go with no scheduler pass
            async with lock:
                pass
        async with trio.open_nursery() as n:
            async def user(name, hold):
                async with lock:
                    order.append(name)
                    await trio.sleep(hold)
                    order.append(f"/{name}")

            async def impatient():
                with trio.move_on_after(0.05):
                    async with lock:
                        order.append("impatient")
            n.start_soon(user, "a", 0.2)
            await trio.sleep(0.01)
            n.start_soon(impatient)
            await trio.sleep(0.01)
            n.start_soon(user, "b", 0)
            await trio.sleep(0.01)
            n.start_soon(user, "c", 0)
        async with lock:                                  # free again at the end
            order.append("end")
    trio.run(main)
    assert order == ["a", "/a", "b", "/b", "c", "/c", "end"]


def test_install_only_on_a_known_pyfuse3(monkeypatch):
    monkeypatch.setattr(pyfuse3, "trio", trio)
    monkeypatch.setattr(pyfuse3, "__version__", "9.0.0")
    assert fuseloop.install() is None and pyfuse3.trio is trio
    monkeypatch.setattr(pyfuse3, "__version__", "3.5.0")
    reads = fuseloop.install()
    assert reads is not None and fuseloop.install() is reads
    assert pyfuse3.trio.lowlevel is reads and pyfuse3.trio.Lock is fuseloop.ReadLock
    assert pyfuse3.trio.open_nursery is trio.open_nursery and reads.notify_closing is trio.lowlevel.notify_closing


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_a_mount_under_concurrent_requests_reads_them_at_once_and_answers_right(cluster, tmp_path):
    """Four threads reading and stat-ing files through a real mount: every byte right, and the mount read
    waiting requests without a wait (``dnfs stats``)."""
    m = Mount(cluster, tmp_path).mount()
    try:
        files = {f"f{i}": pattern(i, 3000 + 911 * i) for i in range(8)}
        for name, data in files.items():
            (m.path / name).write_bytes(data)

        def work(k):
            for _ in range(100):
                for name, data in files.items():
                    assert os.stat(m.path / name).st_size == len(data)
                    assert (m.path / name).read_bytes() == data
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(work, range(4)))
        reads = json.loads(dnfs("stats", m.path, "--json").stdout)["fuse_reads"]
        assert reads["at_once"] > 0 and reads["waited"] > 0, reads
        assert "FUSE requests read at once" in dnfs("stats", m.path).stdout
    finally:
        m.umount()
