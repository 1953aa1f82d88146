"""etcd's database file against the partition count: a 3-node local cluster (`dnctl cluster up`, secured),
N partitions placed by the manager, optionally one failover; prints etcd's dbSize and dbSizeInUse
(``/v3/maintenance/status``) after each step.

    python -m bench.etcd_dbsize --partitions 100 500           # one fresh cluster per count
    python -m bench.etcd_dbsize --partitions 500 --failover    # then SIGKILL node3 and wait for the map
    python -m bench.etcd_dbsize --partitions 500 --settle 120  # and watch it for 120 s (compaction, defrag)

The code measured is whatever ``PYTHONPATH`` (else this checkout) holds, so an older tree can be measured
with this script: ``PYTHONPATH=/tmp/old python -m bench.etcd_dbsize ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
CODE = os.environ.get("PYTHONPATH") or str(REPO)
ENV = {**os.environ, "PYTHONPATH": CODE}


def dnctl(*args, timeout: float = 900) -> str:
    p = subprocess.run([sys.executable, "-m", "tools.dnctl", *map(str, args)], env=ENV, cwd=CODE,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(map(str, args))}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def status(url: str, root: pathlib.Path) -> dict:
    """The member's sizes, after a one-key write as etcd's root user: etcd counts the pages a compaction
    freed as free only once a later write commits (an idle member reports them in use)."""
    from tools.cluster import local_access, local_tls
    from wire.etcdmap import _b64, client
    rec = json.loads((root / "cluster.json").read_text())["etcd"]
    c = client(url, local_access(rec, "root"), timeout=10)
    c.post(c.get_url("/kv/put"), json={"key": _b64("etcd-dbsize-probe"), "value": _b64("1")})
    time.sleep(0.5)
    req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10, context=local_tls(rec, "root")) as r:
        s = json.loads(r.read())
    return {"db_mb": round(int(s["dbSize"]) / 1e6, 2), "in_use_mb": round(int(s["dbSizeInUse"]) / 1e6, 2),
            "revision": int(s["header"]["revision"])}


def partitions(root: pathlib.Path) -> list[dict]:
    out = json.loads(dnctl("partition", "list", "--cluster", root, "--json"))
    return out["partitions"] if isinstance(out, dict) else out


def one(n: int, failover: bool, settle: float):
    with tempfile.TemporaryDirectory(prefix="etcd-dbsize-") as tmp:
        root = pathlib.Path(tmp) / "c"
        dnctl("cluster", "up", "--nodes", 3, "--cluster", root, "--pool-mib", 16, "--min-writable", 0)
        try:
            info = json.loads((root / "cluster.json").read_text())
            url = info["etcd"]["url"]
            yield ({"partitions": n, "step": "up", **status(url, root)})
            t0 = time.monotonic()
            left = n
            while left:
                k = min(left, 1000)
                dnctl("partition", "create", "--count", k, "--replicas", 3, "--cluster", root, "--timeout", 600)
                left -= k
            yield ({"partitions": n, "step": "created", "s": round(time.monotonic() - t0, 1),
                   **status(url, root)})
            if failover:
                victim = info["nodes"][-1]
                os.kill(victim["pid"], signal.SIGKILL)
                t0 = time.monotonic()
                while stuck := [p for p in partitions(root) if victim["addr"] in p["replicas"]]:
                    if time.monotonic() - t0 > 600:
                        keep = pathlib.Path(tempfile.mkdtemp(prefix="etcd-dbsize-failed-"))
                        shutil.copytree(root, keep / "c", ignore=shutil.ignore_patterns("data"))
                        raise SystemExit(f"failover not done within 600 s: {len(stuck)} views still name "
                                         f"{victim['addr']}, e.g. {stuck[0]}; logs copied to {keep}")
                    time.sleep(2)
                yield ({"partitions": n, "step": "failover", "s": round(time.monotonic() - t0, 1),
                             **status(url, root)})
            if settle:
                time.sleep(settle)
                yield ({"partitions": n, "step": f"+{settle:g}s", **status(url, root)})
        finally:
            subprocess.run([sys.executable, "-m", "tools.dnctl", "cluster", "down", "--cluster", str(root)],
                           env=ENV, cwd=CODE, capture_output=True, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partitions", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--failover", action="store_true", help="SIGKILL the last node, wait until no view names it")
    ap.add_argument("--settle", type=float, default=0, help="then wait this many seconds and measure again")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    for n in a.partitions:
        for row in one(n, a.failover, a.settle):
            print(json.dumps(row) if a.json else
                  "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
