"""dnfs for every user, on a real kernel FUSE mount of a real 3-node cluster: the same operations as root
and as unprivileged users (``setpriv`` to nobody or to a bare uid), answered as POSIX and Linux say --
mode bits, ownership and chown rules, sticky directories, set-user-ID clearing, utimensat rules, POSIX ACLs
(enforced), set-group-ID directories, ENAMETOOLONG, "." and "..", directory sizes, statfs that shows the nodes' disks; an
ordinary user's own mount.  The ACL codec and the mount-option rules are tested without a mount."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from client.fs import acl
from client.fs.mount import MountError, mount_options, user_allow_other
from tests.conftest import REPO
from tests.test_dnfs import Mount, cluster  # noqa: F401 - the module's cluster fixture
from tests.test_dnfs_etcd import ETCD, etcd  # noqa: F401 - a real etcd for the etcd engine

MNT_OK = os.path.exists("/dev/fuse") and shutil.which("setpriv") is not None
NOBODY, NOGROUP = 65534, 65534
OTHER = 23456           # a second unprivileged user (no passwd entry needed), own group OTHER
ROOT_FILE_MODES = {"r644": 0o644, "r600": 0o600, "r666": 0o666, "r640": 0o640}

PRE = """
import errno, json, os, sys
os.umask(0o022)
out = {}
def t(k, f):
    try:
        r = f()
        out[k] = "ok" if r is None else r
    except OSError as e:
        out[k] = errno.errorcode[e.errno]
"""


def run_as(uid: int, gid: int, code: str, groups: tuple[int, ...] = ()) -> dict:
    """Run ``code`` (Python, after PRE: ``t(label, fn)`` records "ok", a value or the errno's name) as an
    unprivileged user with the system's Python; returns what it recorded."""
    grp = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    r = subprocess.run(["setpriv", "--reuid", str(uid), "--regid", str(gid), *grp, "/usr/bin/python3", "-c",
                        PRE + textwrap.dedent(code) + "\nprint(json.dumps(out))"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def shared(cluster):  # noqa: F811
    """One mount for the module, made as `dnfs mount` makes it for root (no option given), in a directory
    every user can reach (pytest's own temporary directories are root's alone)."""
    if not MNT_OK:
        pytest.skip("needs /dev/fuse and setpriv")
    base = tempfile.mkdtemp(prefix="dnfs-posix-")
    os.chmod(base, 0o755)
    m = Mount(cluster, __import__("pathlib").Path(base)).mount()
    os.chmod(m.path, 0o755)
    yield m
    m.cleanup()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def d(shared, request):
    """A fresh directory of the shared mount for one test (mode 0777: every user may create in it)."""
    p = shared.path / request.node.name[:60]
    p.mkdir()
    os.chmod(p, 0o777)
    return p


def test_the_mount_is_for_every_user_and_the_kernel_checks_the_mode_bits(shared, d):
    assert "allow_other" in _options(shared.path) and "default_permissions" in _options(shared.path)
    for name, mode in ROOT_FILE_MODES.items():
        (d / name).write_bytes(b"root's " + name.encode())
        os.chmod(d / name, mode)
    got = run_as(NOBODY, NOGROUP, f"""
        d = {str(d)!r}
        t("stat", lambda: os.stat(d + "/r600").st_mode & 0o777)
        t("read644", lambda: open(d + "/r644", "rb").read().decode())
        t("read600", lambda: open(d + "/r600", "rb").read())
        t("write644", lambda: open(d + "/r644", "ab").close())
        t("write666", lambda: open(d + "/r666", "ab").write(b"+"))
        t("chmod", lambda: os.chmod(d + "/r666", 0o777))
        t("create", lambda: open(d + "/mine", "wb").write(b"x"))
        t("owner", lambda: [os.stat(d + "/mine").st_uid, os.stat(d + "/mine").st_gid])
        t("mode", lambda: os.stat(d + "/mine").st_mode & 0o777)
        t("unlink_in_0777_dir", lambda: os.unlink(d + "/r640"))
    """)
    assert got == {"stat": 0o600, "read644": "root's r644", "read600": "EACCES", "write644": "EACCES",
                   "write666": 1, "chmod": "EPERM", "create": 1, "owner": [NOBODY, NOGROUP], "mode": 0o644,
                   "unlink_in_0777_dir": "ok"}
    assert (d / "r666").read_bytes() == b"root's r666+"
    assert not (d / "r640").exists()


def test_without_allow_other_only_the_mounting_user_gets_in(cluster, tmp_path):  # noqa: F811
    if not MNT_OK:
        pytest.skip("needs /dev/fuse and setpriv")
    base = tempfile.mkdtemp(prefix="dnfs-posix-")
    os.chmod(base, 0o755)
    m = Mount(cluster, __import__("pathlib").Path(base)).mount("--no-allow-other")
    try:
        os.chmod(m.path, 0o755)
        assert "allow_other" not in _options(m.path)
        (m.path / "f").write_bytes(b"x")
        os.chmod(m.path / "f", 0o644)
        assert run_as(NOBODY, NOGROUP, f"t('stat', lambda: os.stat({str(m.path / 'f')!r}).st_size)") == \
            {"stat": "EACCES"}
    finally:
        m.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_sticky_directory_only_owners_remove_or_rename(d):
    os.chmod(d, 0o1777)
    run_as(NOBODY, NOGROUP, f"t('a', lambda: open({str(d / 'nobodys')!r}, 'w').close())")
    (d / "roots").write_bytes(b"r")
    os.chmod(d / "roots", 0o666)
    got = run_as(OTHER, OTHER, f"""
        d = {str(d)!r}
        t("unlink_other_users", lambda: os.unlink(d + "/nobodys"))
        t("rename_other_users", lambda: os.rename(d + "/nobodys", d + "/taken"))
        t("replace_other_users", lambda: (open(d + "/own", "w").close(), os.rename(d + "/own", d + "/roots"))[1])
        t("unlink_own", lambda: (open(d + "/own2", "w").close(), os.unlink(d + "/own2"))[1])
        t("rename_own", lambda: (open(d + "/own3", "w").close(), os.rename(d + "/own3", d + "/own4"))[1])
        t("write_other_users_writable", lambda: open(d + "/roots", "ab").write(b"+"))
    """)
    assert got == {"unlink_other_users": "EPERM", "rename_other_users": "EPERM", "replace_other_users": "EPERM",
                   "unlink_own": "ok", "rename_own": "ok", "write_other_users_writable": 1}
    got = run_as(NOBODY, NOGROUP, f"t('unlink_own', lambda: os.unlink({str(d / 'nobodys')!r}))")
    assert got == {"unlink_own": "ok"}
    os.unlink(d / "own4")                     # root may
    assert sorted(os.listdir(d)) == ["own", "roots"]


def test_chown_rules_and_set_user_id_clearing(d):
    f = d / "suid"
    f.write_bytes(b"#!/bin/sh\n")
    os.chmod(f, 0o6777)
    got = run_as(NOBODY, NOGROUP, f"""
        f = {str(f)!r}
        t("chown_not_owner", lambda: os.chown(f, {NOBODY}, -1))
        t("write", lambda: open(f, "ab").write(b"echo\\n"))
        t("mode_after_write", lambda: os.stat(f).st_mode & 0o7777)
        open({str(d / 'mine')!r}, "w").close()
        t("give_away", lambda: os.chown({str(d / 'mine')!r}, 0, -1))
        t("chgrp_not_member", lambda: os.chown({str(d / 'mine')!r}, -1, 0))
        t("chgrp_own_group", lambda: os.chown({str(d / 'mine')!r}, -1, {NOGROUP}))
    """, groups=())
    assert got == {"chown_not_owner": "EPERM", "write": 5, "mode_after_write": 0o777, "give_away": "EPERM",
                   "chgrp_not_member": "EPERM", "chgrp_own_group": "ok"}
    # root's own write keeps the bits (CAP_FSETID); a chown clears them, root's too
    os.chmod(f, 0o6777)
    with open(f, "ab") as fh:
        fh.write(b"# root\n")
    assert os.stat(f).st_mode & 0o7777 == 0o6777
    os.chown(f, NOBODY, NOGROUP)
    assert os.stat(f).st_mode & 0o7777 == 0o777 and (os.stat(f).st_uid, os.stat(f).st_gid) == (NOBODY, NOGROUP)
    # set-group-ID without group execute is not an executable's: a write by another user leaves it
    g = d / "sgid-noexec"
    g.write_bytes(b"")
    os.chmod(g, 0o2666)
    run_as(NOBODY, NOGROUP, f"open({str(g)!r}, 'ab').write(b'x')")
    assert os.stat(g).st_mode & 0o7777 == 0o2666
    # a truncate by another user clears set-user-ID too
    os.chmod(f, 0o4777)
    run_as(OTHER, OTHER, f"t('trunc', lambda: os.truncate({str(f)!r}, 1))")
    assert os.stat(f).st_mode & 0o7777 == 0o777 and os.stat(f).st_size == 1


def test_utimensat_now_for_writers_explicit_times_for_owners(d):
    f = d / "shared"
    f.write_bytes(b"x")
    os.chmod(f, 0o666)
    os.utime(f, ns=(10**18, 10**18))
    ro = d / "readonly"
    ro.write_bytes(b"x")
    os.chmod(ro, 0o644)
    got = run_as(NOBODY, NOGROUP, f"""
        f, ro = {str(f)!r}, {str(ro)!r}
        t("now_as_writer", lambda: os.utime(f))
        t("explicit_as_writer", lambda: os.utime(f, ns=(5, 5)))
        t("now_without_write", lambda: os.utime(ro))
        open({str(d / 'mine')!r}, "w").close()
        t("explicit_as_owner", lambda: os.utime({str(d / 'mine')!r}, ns=(7 * 10**9, 8 * 10**9)))
        t("mine_times", lambda: [os.stat({str(d / 'mine')!r}).st_atime_ns, os.stat({str(d / 'mine')!r}).st_mtime_ns])
    """)
    assert got == {"now_as_writer": "ok", "explicit_as_writer": "EPERM", "now_without_write": "EACCES",
                   "explicit_as_owner": "ok", "mine_times": [7 * 10**9, 8 * 10**9]}
    assert abs(os.stat(f).st_mtime - time.time()) < 120          # "now", not the year 2001 set above


def test_names_longer_than_255_bytes_are_enametoolong_everywhere(d):
    (d / "f").write_bytes(b"x")
    long = str(d / ("n" * 256))
    got = run_as(NOBODY, NOGROUP, f"""
        d, long = {str(d)!r}, {long!r}
        t("stat", lambda: os.stat(long))
        t("open", lambda: open(long))
        t("create", lambda: open(long, "w"))
        t("mkdir", lambda: os.mkdir(long))
        t("mkfifo", lambda: os.mkfifo(long))
        t("symlink", lambda: os.symlink("f", long))
        t("link", lambda: os.link(d + "/f", long))
        t("rename", lambda: os.rename(d + "/f", long))
        t("unlink", lambda: os.unlink(long))
        t("xattr_name", lambda: os.setxattr(d + "/f", "user." + "x" * 251, b"v"))
        t("xattr_255", lambda: os.setxattr(d + "/f", "user." + "x" * 250, b"v"))
        t("xattr_value", lambda: os.setxattr(d + "/f", "user.big", b"v" * 65537))
        t("exact_255", lambda: (open(d + "/" + "m" * 255, "w").close(), os.stat(d + "/" + "m" * 255).st_size)[1])
    """)
    assert got == {"stat": "ENAMETOOLONG", "open": "ENAMETOOLONG", "create": "ENAMETOOLONG",
                   "mkdir": "ENAMETOOLONG", "mkfifo": "ENAMETOOLONG", "symlink": "ENAMETOOLONG",
                   "link": "ENAMETOOLONG", "rename": "ENAMETOOLONG", "unlink": "ENAMETOOLONG",
                   "xattr_name": "ERANGE", "xattr_255": "EACCES", "xattr_value": "E2BIG", "exact_255": 0}


def test_set_group_id_directories_pass_their_group_on(d):
    g = d / "team"
    g.mkdir()
    os.chown(g, 0, NOGROUP)
    os.chmod(g, 0o2777)
    run_as(OTHER, OTHER, f"os.mkdir({str(g / 'sub')!r}); open({str(g / 'file')!r}, 'w').close()")
    sub, f = os.stat(g / "sub"), os.stat(g / "file")
    assert (sub.st_uid, sub.st_gid, stat.S_IMODE(sub.st_mode)) == (OTHER, NOGROUP, 0o2755)
    assert (f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode)) == (OTHER, NOGROUP, 0o644)


def _acl(*entries) -> bytes:
    return acl.encode(list(entries))


U = acl.UNDEFINED_ID


def test_posix_acls_are_enforced_and_keep_the_mode_in_step(d):
    f = d / "private"
    f.write_bytes(b"secret")
    os.chmod(f, 0o600)
    grant = _acl((acl.USER_OBJ, 6, U), (acl.USER, 4, NOBODY), (acl.GROUP_OBJ, 0, U), (acl.MASK, 4, U),
                 (acl.OTHER, 0, U))
    os.setxattr(f, "system.posix_acl_access", grant)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o640                 # group bits show the mask
    read = f"t('read', lambda: open({str(f)!r}, 'rb').read().decode())"
    assert run_as(NOBODY, NOGROUP, read) == {"read": "secret"}       # the named user is let in ...
    assert run_as(OTHER, OTHER, read) == {"read": "EACCES"}          # ... nobody else
    os.chmod(f, 0o600)                                               # a chmod narrows the mask ...
    assert run_as(NOBODY, NOGROUP, read) == {"read": "EACCES"}
    stored = acl.parse(os.getxattr(f, "system.posix_acl_access"))
    assert (acl.MASK, 0, U) in stored and (acl.USER, 4, NOBODY) in stored       # ... and keeps the entry
    os.chmod(f, 0o640)
    assert run_as(NOBODY, NOGROUP, read) == {"read": "secret"}
    # an ACL can deny what the mode bits would allow
    open_ = d / "open"
    open_.write_bytes(b"public")
    os.chmod(open_, 0o644)
    os.setxattr(open_, "system.posix_acl_access", _acl((acl.USER_OBJ, 6, U), (acl.USER, 0, NOBODY),
                                                       (acl.GROUP_OBJ, 4, U), (acl.MASK, 4, U), (acl.OTHER, 4, U)))
    assert run_as(NOBODY, NOGROUP, f"t('read', lambda: open({str(open_)!r}, 'rb').read())") == {"read": "EACCES"}
    assert run_as(OTHER, OTHER, f"t('read', lambda: open({str(open_)!r}, 'rb').read().decode())") == \
        {"read": "public"}
    # only the owner sets one; an ACL the mode says exactly is the mode, and not stored
    assert run_as(NOBODY, NOGROUP, f"t('set', lambda: os.setxattr({str(open_)!r}, 'system.posix_acl_access', "
                                   f"{grant!r}))") == {"set": "EPERM"}
    os.setxattr(open_, "system.posix_acl_access", _acl((acl.USER_OBJ, 7, U), (acl.GROUP_OBJ, 5, U),
                                                       (acl.OTHER, 1, U)))
    assert stat.S_IMODE(os.stat(open_).st_mode) == 0o751
    assert "system.posix_acl_access" not in os.listxattr(open_)
    with pytest.raises(OSError) as e:                                # not a valid ACL: refused
        os.setxattr(open_, "system.posix_acl_access", b"\x02\0\0\0garbage!")
    assert e.value.errno == 22
    # setting an ACL takes set-group-ID from an owner outside the file's group, as chmod does
    run_as(NOBODY, NOGROUP, f"open({str(d / 'sg')!r}, 'w').close()")
    os.chown(d / "sg", NOBODY, 0)
    os.chmod(d / "sg", 0o2750)
    run_as(NOBODY, NOGROUP, f"os.setxattr({str(d / 'sg')!r}, 'system.posix_acl_access', {grant!r})")
    assert stat.S_IMODE(os.stat(d / "sg").st_mode) == 0o640


def test_default_acls_are_inherited(d):
    team = d / "team"
    team.mkdir()
    os.chmod(team, 0o750)
    default = _acl((acl.USER_OBJ, 7, U), (acl.USER, 7, NOBODY), (acl.GROUP_OBJ, 5, U), (acl.MASK, 7, U),
                   (acl.OTHER, 0, U))
    os.setxattr(team, "system.posix_acl_default", default)
    os.setxattr(team, "system.posix_acl_access", _acl((acl.USER_OBJ, 7, U), (acl.USER, 5, NOBODY),
                                                      (acl.GROUP_OBJ, 5, U), (acl.MASK, 5, U), (acl.OTHER, 0, U)))
    old = os.umask(0)                     # (FUSE applies the umask before the filesystem sees the mode)
    try:
        with open(team / "doc", "wb") as fh:
            fh.write(b"for nobody")
        os.mkdir(team / "sub", 0o777)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(team / "doc").st_mode) == 0o660                 # 0666 under the default ACL
    assert acl.parse(os.getxattr(team / "doc", "system.posix_acl_access"))[1] == (acl.USER, 7, NOBODY)
    assert os.getxattr(team / "sub", "system.posix_acl_default") == default
    got = run_as(NOBODY, NOGROUP, f"""
        t("read", lambda: open({str(team / 'doc')!r}, "rb").read().decode())
        t("write", lambda: open({str(team / 'doc')!r}, "ab").write(b"!"))
        t("create_in_sub", lambda: open({str(team / 'sub' / 'x')!r}, "w").close())
    """)
    assert got == {"read": "for nobody", "write": 1, "create_in_sub": "ok"}
    assert run_as(OTHER, OTHER, f"t('ls', lambda: os.listdir({str(team)!r}))") == {"ls": "EACCES"}
    # a symlink takes none; a default ACL on a file is refused
    os.symlink("doc", team / "ln")
    assert os.lstat(team / "ln").st_mode & 0o777 == 0o777
    with pytest.raises(OSError) as e:
        os.setxattr(team / "doc", "system.posix_acl_default", default)
    assert e.value.errno == 13


def test_readdir_lists_dot_and_dotdot_and_directories_have_sizes(d):
    sub = d / "sub"
    sub.mkdir()
    empty = os.stat(sub).st_size
    assert empty > 0
    for i in range(5):
        (sub / f"f{i}").write_bytes(b"")
    (sub / "dir").mkdir()
    full = os.stat(sub).st_size
    assert full > empty
    os.unlink(sub / "f0")
    os.rename(sub / "f1", d / "moved")
    assert empty < os.stat(sub).st_size < full
    for name in os.listdir(sub):
        (os.rmdir if (sub / name).is_dir() else os.unlink)(sub / name)
    assert os.stat(sub).st_size == empty
    lines = subprocess.run(["ls", "-ai1", str(sub)], capture_output=True, text=True, check=True).stdout.split()
    names = dict(zip(lines[1::2], map(int, lines[0::2])))
    assert names == {".": os.stat(sub).st_ino, "..": os.stat(d).st_ino}
    # ".." follows a directory that moved
    (sub / "inner").mkdir()
    other = d / "other"
    other.mkdir()
    os.rename(sub / "inner", other / "inner")
    lines = subprocess.run(["ls", "-ai1", str(other / "inner")], capture_output=True, text=True).stdout.split()
    assert dict(zip(lines[1::2], map(int, lines[0::2])))[".."] == os.stat(other).st_ino
    # a listing that is resumed part-way (a small getdents buffer) still has every entry once
    big = d / "big"
    big.mkdir()
    for i in range(300):
        (big / f"entry-{i:03d}-{'x' * 60}").write_bytes(b"")
    assert sorted(os.listdir(big)) == sorted(f"entry-{i:03d}-{'x' * 60}" for i in range(300))


def test_statfs_adds_up_and_shows_the_nodes_disks(shared, d):
    """Size, available and used are the datanodes' disks (three replicas on one disk here: that disk's
    figures), used the rest -- what the files hold and whatever else fills the disk."""
    disk = os.statvfs(shared.addrs.procs[0].cfg["data_dir"])
    v = os.statvfs(shared.path)
    assert v.f_bfree == v.f_bavail and v.f_blocks >= v.f_bfree
    assert abs(v.f_blocks * v.f_frsize - disk.f_blocks * disk.f_frsize) <= 1 << 20
    used = (v.f_blocks - v.f_bfree) * v.f_frsize
    disk_used = (disk.f_blocks - disk.f_bavail) * disk.f_frsize
    assert abs(used - disk_used) <= 1 << 30        # other programs write on this disk meanwhile
    with open(d / "four-mib", "wb") as f:
        f.write(os.urandom(4 << 20))
    assert v.f_files - v.f_ffree >= 0 and v.f_ffree == v.f_favail
    deadline = time.monotonic() + 10
    while True:
        v2 = os.statvfs(shared.path)
        if v2.f_files - v2.f_ffree >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert v2.f_files - v2.f_ffree >= 3            # the root, this directory and the file


def test_an_ordinary_user_mounts_for_itself(cluster, tmp_path):  # noqa: F811
    """nobody mounts (fusermount3) on a directory of its own, uses it, and root -- not allowed in -- cannot.
    /dev/fuse is 0600 on some machines: a private mount namespace gives this test a 0666 node of its own."""
    if not MNT_OK or shutil.which("unshare") is None or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse, setpriv, unshare and fusermount3")
    base = tempfile.mkdtemp(prefix="dnfs-user-")
    os.chmod(base, 0o755)
    home = os.path.join(base, "home")
    os.makedirs(os.path.join(home, "m"))
    os.makedirs(os.path.join(base, "dev"))
    shutil.chown(home, NOBODY, NOGROUP)
    shutil.chown(os.path.join(home, "m"), NOBODY, NOGROUP)
    script = os.path.join(base, "inside.sh")
    mount = (f"import os, sys; sys.path.insert(0, {str(REPO)!r}); "
             "import client.fs.cli as cli, client.fs.meta_sqlite, client.sdk, wire.auth, wire.transport.tls; "
             f"os.setgroups([]); os.setgid({NOGROUP}); os.setuid({NOBODY}); "
             f"sys.argv = ['dnfs', 'mount', '--foreground', '--meta', 'sqlite:{home}/meta.db', "
             f"'--node', {cluster[0]!r}, '--timeout', '15'] + sys.argv[1:] + ['{home}/m']; cli.main()")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""\
            set -u
            mount -t tmpfs -o mode=755 tmpfs {base}/dev && mknod -m 666 {base}/dev/fuse c 10 229 &&
                mount --bind {base}/dev/fuse /dev/fuse || exit 3
            {sys.executable} -c "{mount}" --allow-other > {base}/refused.log 2>&1
            echo "refused=$?"
            {sys.executable} -c "{mount}" > {base}/mount.log 2>&1 &
            for i in $(seq 150); do grep -q " {home}/m " /proc/mounts && break; sleep 0.2; done
            grep " {home}/m " /proc/mounts | cut -d' ' -f4
            setpriv --reuid {NOBODY} --regid {NOGROUP} --clear-groups sh -c \
                'echo hello > {home}/m/f && cat {home}/m/f && stat -c "%U %a" {home}/m/f' 2>&1
            ls {home}/m > /dev/null 2>&1; echo "root_ls=$?"
            setpriv --reuid {NOBODY} --regid {NOGROUP} --clear-groups fusermount3 -u {home}/m; echo "umount=$?"
            wait; echo "mount_exit=$?"
            """))
    try:
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", script], capture_output=True,
                           text=True, timeout=180)
        if r.returncode == 3:
            pytest.skip(f"cannot set up a private /dev/fuse: {r.stderr.strip()}")
        out = r.stdout.split("\n")
        log = open(os.path.join(base, "mount.log")).read()
        assert out[0] == "refused=1", (r.stdout, r.stderr)
        assert "user_allow_other" in open(os.path.join(base, "refused.log")).read()
        opts = out[1].split(",")
        assert "allow_other" not in opts and "default_permissions" in opts and f"user_id={NOBODY}" in opts, \
            (r.stdout, log)
        assert out[2:4] == ["hello", "nobody 644"], (r.stdout, log)
        assert out[4] != "root_ls=0" and out[5:7] == ["umount=0", "mount_exit=0"], (r.stdout, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------- without a mount
def test_mount_options_root_shares_users_keep_to_themselves():
    assert mount_options(7, 0, None, None) >= {"allow_other", "default_permissions", "fsname=dnfs-7"}
    assert "allow_other" not in mount_options(7, 0, False, None)
    assert "allow_other" not in mount_options(7, 1000, None, None)
    assert "default_permissions" in mount_options(7, 1000, None, None)
    with pytest.raises(MountError, match="user_allow_other"):
        mount_options(7, 1000, True, "# user_allow_other\n")
    assert "allow_other" in mount_options(7, 1000, True, "mount_max = 10\n  user_allow_other  \n")
    assert not user_allow_other("#user_allow_other") and user_allow_other("user_allow_other # yes")


def test_acl_codec_and_mode_rules():
    entries = [(acl.USER_OBJ, 6, U), (acl.USER, 4, 1000), (acl.GROUP_OBJ, 4, U), (acl.GROUP, 6, 50),
               (acl.MASK, 6, U), (acl.OTHER, 0, U)]
    raw = acl.encode(entries)
    assert acl.parse(raw) == entries and acl.mode_bits(entries) == 0o660 and not acl.equivalent(entries)
    assert acl.chmod(entries, 0o751) == [(acl.USER_OBJ, 7, U), (acl.USER, 4, 1000), (acl.GROUP_OBJ, 4, U),
                                         (acl.GROUP, 6, 50), (acl.MASK, 5, U), (acl.OTHER, 1, U)]
    base = [(acl.USER_OBJ, 6, U), (acl.GROUP_OBJ, 4, U), (acl.OTHER, 4, U)]
    assert acl.equivalent(base) and acl.chmod(base, 0o640) == [(acl.USER_OBJ, 6, U), (acl.GROUP_OBJ, 4, U),
                                                               (acl.OTHER, 0, U)]
    for bad in (b"", raw[:-1], b"\x01\0\0\0" + raw[4:], acl.encode([(acl.USER, 4, 1), (acl.USER_OBJ, 6, U)]),
                acl.encode(entries[:4] + entries[5:]),                   # named entries without a mask
                acl.encode([(acl.USER_OBJ, 8, U), (acl.GROUP_OBJ, 4, U), (acl.OTHER, 4, U)]),
                acl.encode([(acl.USER_OBJ, 6, U), (acl.USER, 4, 1), (acl.USER, 4, 1), (acl.GROUP_OBJ, 4, U),
                            (acl.MASK, 4, U), (acl.OTHER, 4, U)])):
        with pytest.raises(acl.AclError):
            acl.parse(bad)
    # inheritance: the default ACL laid over the requested mode; a directory keeps the default too
    dflt = acl.encode([(acl.USER_OBJ, 7, U), (acl.USER, 7, 1000), (acl.GROUP_OBJ, 5, U), (acl.MASK, 7, U),
                       (acl.OTHER, 0, U)])
    mode, access, default = acl.inherit(dflt, stat.S_IFREG | 0o666)
    assert mode == stat.S_IFREG | 0o660 and default is None
    assert acl.parse(access) == [(acl.USER_OBJ, 6, U), (acl.USER, 7, 1000), (acl.GROUP_OBJ, 5, U),
                                 (acl.MASK, 6, U), (acl.OTHER, 0, U)]
    mode, access, default = acl.inherit(dflt, stat.S_IFDIR | 0o2755)
    assert mode == stat.S_IFDIR | 0o2750 and default == dflt and acl.parse(access)[3] == (acl.MASK, 5, U)
    plain = acl.encode([(acl.USER_OBJ, 7, U), (acl.GROUP_OBJ, 0, U), (acl.OTHER, 0, U)])
    assert acl.inherit(plain, stat.S_IFREG | 0o644) == (stat.S_IFREG | 0o600, None, None)
    assert acl.inherit(dflt, stat.S_IFLNK | 0o777) == (stat.S_IFLNK | 0o777, None, None)
    status = "Name:\tx\nGid:\t100\t100\t100\t100\nGroups:\t5 7 \nCapEff:\t0000000000000000\n"
    assert acl.in_group_or_capable(status, 7) and acl.in_group_or_capable(status, 100)
    assert not acl.in_group_or_capable(status, 8)
    assert acl.kernel_enforces("6.18.44-fc") and acl.kernel_enforces("4.9.0") and not acl.kernel_enforces("4.4.0-1")
    assert acl.in_group_or_capable(status.replace("CapEff:\t0000000000000000", "CapEff:\t0000000000000010"), 8)


def _options(path) -> list[str]:
    for line in open("/proc/mounts"):
        f = line.split()
        if f[1] == str(path):
            return f[3].split(",")
    raise AssertionError(f"{path} is not mounted")


@pytest.fixture(params=["sqlite", "etcd"])
def engine(request, tmp_path):
    """Each metadata engine, opened on a fresh store (etcd: a real etcd process, a volume of its own)."""
    if request.param == "sqlite":
        from client.fs.meta_sqlite import SqliteMeta
        return lambda: SqliteMeta(str(tmp_path / "m.db"))
    if not os.path.exists(ETCD):
        pytest.skip("no etcd binary (Debian: etcd-server)")
    from client.fs.meta_etcd import EtcdMeta
    url = request.getfixturevalue("etcd")
    return lambda: EtcdMeta(f"etcd://{url}/{request.node.name[-20:].replace('[', '-').replace(']', '')}")


def test_the_engines_keep_directory_sizes_set_group_id_and_acls_in_their_transactions(engine):
    """The rules behind the mount, on each engine: a directory's size follows its entries through every
    namespace change; a set-group-ID directory passes on its group; ACL inheritance, set and chmod change the
    mode and the stored ACL together; usage counts every inode."""
    from client.fs.meta import DIRENT, ROOT
    reg, dir_ = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755

    async def main():
        m = engine()
        try:
            size = lambda ino: m.getattr(ino)                     # noqa: E731
            a = await m.create(ROOT, b"a", dir_, 0, 0)
            b = await m.create(ROOT, b"b", dir_, 0, 0)
            assert (await size(a.ino)).size == 2 * DIRENT
            f = await m.create(a.ino, b"f", reg, 0, 0)
            await m.create(a.ino, b"g", reg, 0, 0)
            await m.link(f.ino, a.ino, b"f2")
            assert (await size(a.ino)).size == 5 * DIRENT
            await m.rename(a.ino, b"f2", b.ino, b"f2")                       # moves across
            await m.rename(a.ino, b"g", a.ino, b"f")                         # replaces within
            assert ((await size(a.ino)).size, (await size(b.ino)).size) == (3 * DIRENT, 3 * DIRENT)
            await m.unlink(a.ino, b"f")
            await m.unlink(b.ino, b"f2")
            await m.rmdir(ROOT, b"b")
            assert (await size(a.ino)).size == 2 * DIRENT and (await size(ROOT)).size == 4 * DIRENT   # a, p
            # set-group-ID directory
            await m.setattr(a.ino, mode=0o2775, gid=500, ctime_ns=1)
            sub = await m.create(a.ino, b"sub", dir_, 7, 7)
            doc = await m.create(a.ino, b"doc", reg, 7, 7)
            assert (sub.gid, sub.mode & 0o7777, doc.gid, doc.mode & 0o7777) == (500, 0o2755, 500, 0o644)
            # ACLs: inherited with the mode in one transaction; chmod rewrites the mask; an ACL equal to
            # the mode is dropped
            dflt = _acl((acl.USER_OBJ, 7, U), (acl.USER, 7, 1000), (acl.GROUP_OBJ, 5, U), (acl.MASK, 7, U),
                        (acl.OTHER, 0, U))
            await m.setxattr(sub.ino, acl.DEFAULT, dflt)
            x = await m.create(sub.ino, b"x", stat.S_IFREG | 0o666, 7, 7)
            assert x.mode & 0o777 == 0o660 and x.gid == 500
            assert acl.parse(await m.getxattr(x.ino, acl.ACCESS))[3] == (acl.MASK, 6, U)
            x = await m.setattr(x.ino, mode=0o640, ctime_ns=2)
            assert acl.parse(await m.getxattr(x.ino, acl.ACCESS))[3] == (acl.MASK, 4, U)
            x = await m.set_acl(x.ino, _acl((acl.USER_OBJ, 7, U), (acl.GROUP_OBJ, 0, U), (acl.OTHER, 0, U)),
                                keep_sgid=True, ctime_ns=3)
            assert x.mode & 0o777 == 0o700 and acl.ACCESS not in await m.listxattr(x.ino)
            await m.setattr(x.ino, mode=0o2770, ctime_ns=4)
            x = await m.set_acl(x.ino, dflt, keep_sgid=False, ctime_ns=5)
            assert x.mode & 0o7777 == 0o770 and await m.getxattr(x.ino, acl.ACCESS) == dflt
            await m.create(ROOT, b"ln", stat.S_IFLNK | 0o777, 0, 0, target=b"a")
            for ino in await m.orphans():                   # the two files unlinked above
                await m.remove(ino)
            assert (await m.usage())[0] == 7                # root, a, sub, doc, x, ln ... and the fifo below
        finally:
            await m.close()

    async def with_fifo():
        m = engine()
        try:
            await m.create(ROOT, b"p", stat.S_IFIFO | 0o600, 0, 0)
        finally:
            await m.close()
    import trio
    trio.run(with_fifo)
    trio.run(main)
