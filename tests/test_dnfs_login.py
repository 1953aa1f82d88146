"""dnfs on a cluster that authenticates: `dnctl cluster up --secret`, then `dnfs mount --cluster DIR` and
`dnfs fsck --cluster DIR` use DIR/cluster.secret by themselves; without the secret, or with another
cluster's, each says so in one line (no traceback) and names the way out.  Real processes, a real mount."""
from __future__ import annotations

import functools
import json
import os
import secrets
import subprocess

import pytest

from tests.conftest import REPO, pattern, run_cli

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
ENV = {k: v for k, v in os.environ.items() if k not in ("DATANODE_SECRET_FILE", "DATANODE_TLS_CA")}
ENV["PYTHONPATH"] = str(REPO)


cli = functools.partial(run_cli, check=True, env=ENV)


def one_line_refusal(r: subprocess.CompletedProcess, *words: str) -> str:
    err = r.stderr.strip()
    assert r.returncode == 1, (r.returncode, r.stdout, err)
    assert "Traceback" not in err + r.stdout and len(err.splitlines()) == 1, err
    assert err.startswith("Error: "), err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """A 1-node cluster made with `dnctl cluster up --secret` (etcd and the manager too)."""
    root = tmp_path_factory.mktemp("login") / "c"
    cli("tools.dnctl", "cluster", "up", "--nodes", 1, "--cluster", root, "--secret")
    try:
        yield root
    finally:
        cli("tools.dnctl", "cluster", "down", "--cluster", root, "--timeout", 10, check=False)


def test_mount_and_fsck_with_cluster_dir_use_its_secret(secure, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = json.loads(cli("client.fs.cli", "mount", "--cluster", secure, mnt, "--json").stdout)
    try:
        (mnt / "f").write_bytes(pattern(1, 300 << 10))
        assert (mnt / "f").read_bytes() == pattern(1, 300 << 10)
    finally:
        cli("client.fs.cli", "umount", mnt)
    assert out["mountpoint"] == str(mnt)
    r = cli("client.fs.cli", "fsck", "--cluster", secure)
    assert "clean" in r.stdout, r.stdout


def test_without_the_secret_each_command_says_what_is_missing_in_one_line(secure, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = json.loads((secure / "cluster.json").read_text())
    addr = info["nodes"][0]["addr"]
    meta = f"sqlite:{tmp_path / 'meta.db'}"

    # a bare address: nothing says where a secret is
    for args in (["mount", "--node", addr, "--meta", meta, mnt], ["fsck", "--node", addr, "--meta", meta]):
        r = cli("client.fs.cli", *args, check=False)
        one_line_refusal(r, addr, "requires authentication", "--secret-file")
    # the cluster directory whose secret went missing
    os.rename(secure / "cluster.secret", tmp_path / "moved.secret")
    try:
        for args in (["mount", "--cluster", secure, mnt], ["fsck", "--cluster", secure]):
            r = cli("client.fs.cli", *args, check=False)
            one_line_refusal(r, "cluster.secret", "--secret-file")
        # ... and given by hand: it works
        r = cli("client.fs.cli", "fsck", "--cluster", secure, "--secret-file", tmp_path / "moved.secret")
        assert "clean" in r.stdout
    finally:
        os.rename(tmp_path / "moved.secret", secure / "cluster.secret")
    # another cluster's secret
    wrong = tmp_path / "wrong.secret"
    wrong.write_text(secrets.token_hex(32) + "\n")
    for args in (["mount", "--cluster", secure, "--secret-file", wrong, mnt],
                 ["fsck", "--cluster", secure, "--secret-file", wrong]):
        r = cli("client.fs.cli", *args, check=False)
        one_line_refusal(r, str(wrong), "not this cluster's", "--secret-file")
    assert not os.path.ismount(mnt)
