#!/usr/bin/env python3
"""Soft-RoCE test VM harness: real kernel RDMA verbs (rdma_rxe) on machines without RDMA.

The host kernel has no RDMA support, so we boot Debian's stock kernel in qemu, load ``rdma_rxe``, bind a
Soft-RoCE device ``rxe0`` to a ``dummy0`` netdev (10.0.0.1/24, GID index 1 = ::ffff:10.0.0.1, RoCE v2)
and run one command inside it.  The VM's root filesystem is the host's own ``/`` shared read-only over 9p
with a tmpfs overlay on top, so the checkout, its ``.venv-rdma`` and Debian's rdma userland are visible at
the same paths; writes inside the VM go to RAM and vanish at power-off (use /tmp, a fresh tmpfs).

    lab/softroce-vm setup                   # build the VM artifacts + <checkout>/.venv-rdma (idempotent)
    lab/softroce-vm run [--timeout S] -- CMD...
    lab/softroce-vm status                  # what exists

Run-time environment knobs: SOFTROCE_VM_DIR (artifact cache, default /var/cache/datanode-softroce),
VM_MEM (4G), VM_CPUS (host cpus, at most 4), VM_ACCEL (auto|kvm|tcg), VM_CPU (TCG's CPU model, default max),
VM_QEMU_EXTRA, VM_TIMEOUT (900 s),
VM_NET_MTU (netdev MTU; default 9000, which gives RoCE active_mtu 4096: in ``bench/verbs_ratio.py`` (3 VM runs,
6 interleaved pairs) leader ingest over verbs was 13.9 MB/s median at 4096 against 6.4 at 1024 (per pair
0.8-3.8x): fewer packets for rxe to emulate).
Inside: CMD runs as root in the checkout with <checkout>/.venv-rdma/bin first on PATH and
DATANODE_RDMA_DEVICE=rxe0, DATANODE_RDMA_GID_INDEX=1, DATANODE_RDMA_ADDR=10.0.0.1, TMPDIR=/tmp exported
(plus any DATANODE_*/PYTEST_*/HYPOTHESIS_* from the caller and --env K=V); /job is the job dir (host, rw).
Exit status: CMD's; 125 when the VM never finished (console log path printed).

Stdlib only; needs root + Debian 12 apt for ``setup``.
"""
from __future__ import annotations

import argparse
import hashlib
import lzma
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
VENV = CHECKOUT / ".venv-rdma"
SYSTEM_PYTHON = "/usr/bin/python3"
DEFAULT_DIR = "/var/cache/datanode-softroce"
RDMA_DEVICE = "rxe0"
RDMA_GID_INDEX = 1
RDMA_ADDR = "10.0.0.1"
DEFAULT_NET_MTU = 9000          # RoCE active_mtu 4096 (1500 gives 1024)

APT_PACKAGES = [
    "qemu-system-x86", "busybox-static", "cpio", "kmod", "xz-utils", "iproute2",
    "rdma-core", "ibverbs-utils", "ibverbs-providers", "rdmacm-utils", "perftest",
    "python3-pyverbs", "python3-venv",
]
# modules for stage 2: rxe (+ the crc32 implementations its ICRC needs, else `rdma link add` fails with
# ENOENT), rdma_cm userspace access, netdevs
STAGE2_MODULES = ["rdma_rxe", "rdma_ucm", "ib_uverbs", "ib_umad", "dummy", "veth", "virtio_net",
                  "crc32_generic", "crc32_pclmul"]
STAGE1_MODULES = ["virtio_pci", "9pnet_virtio", "9p", "overlay"]

# Stage 1: PID 1 in the busybox initramfs. host / (9p, ro) + tmpfs overlay -> /newroot; job dir (9p, rw).
INIT_SH = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
die() { echo "STAGE1 FAILED: $*"; echo o > /proc/sysrq-trigger; sleep 5; }
for m in $(cat /mods/order); do insmod /mods/$m || echo "insmod $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /lower || die "9p root"
mount -t tmpfs -o size=${rwsize:-50%} tmpfs /rw && mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || die overlay
mkdir -p /newroot/job
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 job /newroot/job || die "9p job"
mount --move /proc /newroot/proc; mount --move /sys /newroot/sys; mount --move /dev /newroot/dev
exec switch_root /newroot "$stage2"
"""

# Stage 2: PID 1 with root = host / + overlay. Parameters come from the kernel command line (as env).
STAGE2_SH = r"""#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
: "${rxe_netdev:=dummy}"
up() { cut -d' ' -f1 /proc/uptime; }
mount -t tmpfs tmpfs /run; mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
# a fresh /tmp, unless the checkout itself lives under /tmp (then the overlay's /tmp, writable, is kept)
[ "${keeptmp:-0}" = 1 ] || mount -t tmpfs -o size=${tmpsize:-75%},mode=1777 tmpfs /tmp
mkdir -p /lib/modules && ln -sfn "$moddir" /lib/modules/$(uname -r)
echo "STAGE2 up at $(up)s"
hostname rxevm; ip link set lo up
ulimit -l unlimited 2>/dev/null
modprobe rdma_rxe && modprobe rdma_ucm || echo "modprobe failed"
ND=
case "$rxe_netdev" in
  none) ;;
  dummy) ip link add dummy0 type dummy && ND=dummy0 ;;
  virtio) modprobe virtio_net; sleep 0.5; ND=$(ls /sys/class/net | grep -v '^lo$' | head -1) ;;
  *) ND=$rxe_netdev ;;
esac
if [ -n "$ND" ]; then
  [ -n "${netmtu:-}" ] && ip link set "$ND" mtu "$netmtu"
  ip addr add __ADDR__/24 dev "$ND"; ip link set "$ND" up
  rdma link add __DEV__ type rxe netdev "$ND" || echo "rdma link add failed"
fi
echo "RXE ready at $(up)s on ${ND:-none}"
echo "$(up)" > /job/t_ready
( sh /job/cmd.sh ) > /job/output.log 2>&1 < /dev/null
echo $? > /job/rc.tmp; mv /job/rc.tmp /job/rc
echo "CMD done rc=$(cat /job/rc) at $(up)s"
sync; echo 1 > /proc/sys/kernel/sysrq; echo o > /proc/sysrq-trigger; sleep 5
""".replace("__ADDR__", RDMA_ADDR).replace("__DEV__", RDMA_DEVICE)

# bump to force a rebuild of the artifacts when the build logic changes. (stage2.sh is not part of the
# artifacts: each run writes it into its job dir, so it always matches this file.)
BUILD_VERSION = "1"


def log(msg: str) -> None:
    print(f"[softroce-vm] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("SOFTROCE_VM_DIR") or DEFAULT_DIR)


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def templates_hash() -> str:
    h = hashlib.sha256()
    for part in (BUILD_VERSION, INIT_SH, " ".join(STAGE1_MODULES), " ".join(STAGE2_MODULES)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- setup
class AptState:
    updated = False

    def update(self) -> None:
        if not self.updated:
            log("apt-get update")
            sh(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL)
            self.updated = True


def missing_packages(pkgs: list[str]) -> list[str]:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *pkgs],
                       capture_output=True, text=True)
    ok = {line.split()[0] for line in r.stdout.splitlines() if len(line.split()) > 1 and line.split()[1] == "ii"}
    return [p for p in pkgs if p not in ok]


def ensure_packages(apt: AptState) -> None:
    missing = missing_packages(APT_PACKAGES)
    if not missing:
        return
    if os.geteuid() != 0:
        sys.exit(f"softroce-vm setup: need root to install {' '.join(missing)}")
    apt.update()
    log(f"apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sh(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env, stdout=subprocess.DEVNULL)


def kernel_package(apt: AptState) -> str:
    def depends() -> str | None:
        r = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            line = line.strip()
            if line.startswith("Depends: linux-image-"):
                return line.split()[1]
        return None

    pkg = depends()
    if pkg is None:
        apt.update()
        pkg = depends()
    if pkg is None:
        sys.exit("softroce-vm setup: cannot resolve linux-image-amd64 (apt-cache depends)")
    return pkg


def module_files(kroot: Path, kver: str, mods: list[str]) -> list[Path]:
    out: list[Path] = []
    for m in mods:
        r = sh(["modprobe", "-d", str(kroot), "-S", kver, "--show-depends", m], capture_output=True, text=True)
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) >= 2 and f[0] == "insmod" and Path(f[1]) not in out:
                out.append(Path(f[1]))
    return out


def extract_vmlinux(vmlinuz: Path, dest: Path) -> bool:
    """The bzImage payload is xz: decompress it to an ELF vmlinux that qemu boots directly (PVH note),
    skipping the slow in-guest decompression under TCG."""
    data = vmlinuz.read_bytes()
    off = data.find(b"\xfd7zXZ\x00")
    if off < 0:
        return False
    try:
        elf = lzma.LZMADecompressor().decompress(data[off:])
    except lzma.LZMAError:
        return False
    if not elf.startswith(b"\x7fELF"):
        return False
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(elf)
    tmp.replace(dest)
    return True


def build_vm(d: Path, apt: AptState, force: bool) -> None:
    stamp = d / "stamp"
    want = templates_hash()
    if not force and stamp.is_file():
        fields = dict(line.split("=", 1) for line in stamp.read_text().split() if "=" in line)
        if fields.get("templates") == want and (d / "initrd.img").is_file() and (d / "kmod").is_dir():
            log(f"VM artifacts up to date in {d} (kernel {fields.get('kernel')})")
            return
    d.mkdir(parents=True, exist_ok=True)
    kpkg = kernel_package(apt)
    kver = kpkg.removeprefix("linux-image-")
    debs = sorted(d.glob(f"{kpkg}_*.deb"))
    if not debs:
        apt.update()
        log(f"apt-get download {kpkg}")
        sh(["apt-get", "download", "-q", kpkg], cwd=d, stdout=subprocess.DEVNULL)
        debs = sorted(d.glob(f"{kpkg}_*.deb"))
    kroot = d / "kpkg"
    shutil.rmtree(kroot, ignore_errors=True)
    log(f"unpacking {debs[-1].name}")
    sh(["dpkg-deb", "-x", str(debs[-1]), str(kroot)])
    sh(["depmod", "-b", str(kroot), kver])
    vmlinuz = kroot / "boot" / f"vmlinuz-{kver}"
    shutil.copyfile(vmlinuz, d / "vmlinuz")
    if not extract_vmlinux(vmlinuz, d / "vmlinux"):
        log("could not extract vmlinux; will boot the compressed vmlinuz (slower)")
        (d / "vmlinux").unlink(missing_ok=True)

    # stage-2 module tree (only what we need)
    msrc = kroot / "lib" / "modules" / kver
    kmod = d / "kmod"
    shutil.rmtree(kmod, ignore_errors=True)
    mdst = kmod / "lib" / "modules" / kver
    mdst.mkdir(parents=True)
    for f in module_files(kroot, kver, STAGE2_MODULES):
        rel = f.resolve().relative_to(msrc.resolve())
        (mdst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, mdst / rel)
    for name in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        shutil.copyfile(msrc / name, mdst / name)
    sh(["depmod", "-b", str(kmod), kver])

    # stage-1 initramfs
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        root = Path(tmp)
        for sub in ("bin", "mods", "proc", "sys", "dev", "newroot", "lower", "rw"):
            (root / sub).mkdir()
        shutil.copyfile("/bin/busybox", root / "bin" / "busybox")
        (root / "bin" / "busybox").chmod(0o755)
        order = []
        for f in module_files(kroot, kver, STAGE1_MODULES):
            shutil.copyfile(f, root / "mods" / f.name)
            order.append(f.name)
        (root / "mods" / "order").write_text("\n".join(order) + "\n")
        (root / "init").write_text(INIT_SH)
        (root / "init").chmod(0o755)
        files = sh(["find", "."], cwd=root, capture_output=True).stdout
        cpio = sh(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files, capture_output=True).stdout
        import gzip
        (d / "initrd.img.tmp").write_bytes(gzip.compress(cpio, compresslevel=1))
        (d / "initrd.img.tmp").replace(d / "initrd.img")
    shutil.rmtree(kroot, ignore_errors=True)  # keep the .deb, drop the 400 MB unpacked tree
    (d / "jobs").mkdir(exist_ok=True)
    stamp.write_text(f"kernel={kver}\ntemplates={want}\n")
    log(f"built VM artifacts in {d} for kernel {kver}")


def pyproject_hash() -> str:
    return hashlib.sha256((CHECKOUT / "pyproject.toml").read_bytes()).hexdigest()[:16]


def build_venv(force: bool) -> None:
    stamp = VENV / ".softroce-stamp"
    py = VENV / "bin" / "python"
    want = pyproject_hash()
    if not force and stamp.is_file() and stamp.read_text().strip() == want and py.exists():
        r = subprocess.run([str(py), "-c", "import pyverbs.device, trio, cffi, pytest, datanode"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            log(f"venv up to date: {VENV}")
            return
        log(f"venv check failed, reinstalling: {r.stderr.strip().splitlines()[-1:]}")
    if not py.exists() or force:
        log(f"creating {VENV} ({SYSTEM_PYTHON} -m venv --system-site-packages)")
        sh([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", "--clear", str(VENV)])
    log("pip install -e '.[test]'")
    sh([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", ".[test]"], cwd=CHECKOUT)
    sh([str(py), "-c", "import pyverbs.device, trio, cffi, pytest, datanode"])
    stamp.write_text(want + "\n")


def cmd_setup(args) -> int:
    t0 = time.monotonic()
    apt = AptState()
    d = cache_dir()
    ensure_packages(apt)
    if not args.venv_only:
        build_vm(d, apt, args.force)
    if not args.vm_only:
        build_venv(args.force)
    log(f"setup done in {time.monotonic() - t0:.1f}s")
    return 0


def cmd_status(args) -> int:
    d = cache_dir()
    stamp = d / "stamp"
    print(f"cache dir: {d} ({'built: ' + stamp.read_text().split()[0] if stamp.is_file() else 'not built'})")
    print(f"venv: {VENV} ({'present' if (VENV / '.softroce-stamp').is_file() else 'missing'})")
    miss = missing_packages(APT_PACKAGES)
    print(f"apt packages missing: {' '.join(miss) or 'none'}")
    print(f"accel: {pick_accel()}")
    return 0 if stamp.is_file() and not miss and (VENV / ".softroce-stamp").is_file() else 1


# ------------------------------------------------------------------------------------------------ run
def pick_accel() -> str:
    accel = os.environ.get("VM_ACCEL", "auto")
    if accel == "auto":
        # /dev/kvm here is PVM (kvm_pvm), which cannot usefully run a stock kernel -> TCG
        ok = os.access("/dev/kvm", os.W_OK) and not Path("/sys/module/kvm_pvm").exists()
        accel = "kvm" if ok else "tcg"
    return accel


def write_cmd_sh(job: Path, argv: list[str], env: dict[str, str]) -> None:
    lines = ["#!/bin/sh", f"cd {shlex.quote(str(CHECKOUT))} || exit 126",
             f"export PATH={shlex.quote(str(VENV / 'bin'))}:\"$PATH\"",
             f"export VIRTUAL_ENV={shlex.quote(str(VENV))}"]
    base = {"DATANODE_RDMA_DEVICE": RDMA_DEVICE, "DATANODE_RDMA_GID_INDEX": str(RDMA_GID_INDEX),
            "DATANODE_RDMA_ADDR": RDMA_ADDR, "TMPDIR": "/tmp", "PYTHONUNBUFFERED": "1",
            "SOFTROCE_VM": "1", "SOFTROCE_JOB_DIR": "/job"}
    base.update(env)
    for k, v in base.items():
        lines.append(f"export {k}={shlex.quote(v)}")
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    (job / "cmd.sh").write_text("\n".join(lines) + "\n")


def cmd_run(args) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        log("run: no command given (usage: softroce-vm run [--timeout S] -- CMD...)")
        return 2
    d = cache_dir()
    kver = None
    stamp = d / "stamp"
    if stamp.is_file():
        kver = dict(line.split("=", 1) for line in stamp.read_text().split() if "=" in line).get("kernel")
    if not kver or not (d / "initrd.img").is_file():
        log(f"no VM artifacts in {d}: run `lab/softroce-vm setup` first")
        return 125
    if not (VENV / "bin" / "python").exists():
        log(f"warning: {VENV} missing (run `lab/softroce-vm setup`); CMD gets the plain PATH")

    # pass through DATANODE_* / PYTEST_* settings and explicit --env
    env = {k: v for k, v in os.environ.items() if k.startswith(("DATANODE_", "PYTEST_", "HYPOTHESIS_"))}
    for item in args.env or []:
        k, _, v = item.partition("=")
        env[k] = v
    (d / "jobs").mkdir(parents=True, exist_ok=True)
    for old in (d / "jobs").glob("job-*"):   # failed runs keep their job dir; prune after two days
        try:
            if time.time() - old.stat().st_mtime > 2 * 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    job = Path(tempfile.mkdtemp(prefix="job-", dir=d / "jobs"))
    job.chmod(0o777)
    write_cmd_sh(job, argv, env)
    (job / "stage2.sh").write_text(STAGE2_SH)
    (job / "stage2.sh").chmod(0o755)

    accel = pick_accel()
    # under TCG, "max" rather than "qemu64": SSE4.2 and PCLMULQDQ, so the crc32c package (our data path) and
    # the kernel's crc32 (rxe's ICRC) take their instruction paths instead of table code, as on real machines
    acc = (["-accel", "kvm", "-cpu", "host"] if accel == "kvm"
           else ["-accel", "tcg,thread=multi", "-cpu", os.environ.get("VM_CPU", "max")])
    kernel = d / "vmlinux"
    if not kernel.is_file() or kernel.stat().st_size == 0:
        kernel = d / "vmlinuz"
    mem = os.environ.get("VM_MEM", "4G")
    cpus = os.environ.get("VM_CPUS") or str(min(4, os.cpu_count() or 2))
    append = (f"console=ttyS0 quiet panic=-1 mitigations=off stage2=/job/stage2.sh "
              f"moddir={d}/kmod/lib/modules/{kver} rwsize={args.rw_size} tmpsize={args.tmp_size} "
              f"keeptmp={1 if str(CHECKOUT).startswith('/tmp/') else 0} "
              f"rxe_netdev={args.netdev}" + (f" netmtu={args.mtu}" if args.mtu else ""))
    console = job / "console.log"
    qemu = ["qemu-system-x86_64", *acc, "-m", mem, "-smp", cpus,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-serial", f"file:{console}",
            "-kernel", str(kernel), "-initrd", str(d / "initrd.img"), "-append", append,
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={job},mount_tag=job,security_model=none,multidevs=remap",
            *shlex.split(os.environ.get("VM_QEMU_EXTRA", ""))]
    t0 = time.monotonic()
    proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=open(job / "qemu.stderr", "wb"), start_new_session=True)
    out_path, rc_path = job / "output.log", job / "rc"
    pos = 0
    t_cmd = None
    timed_out = False
    stdout = sys.stdout.buffer

    def pump() -> None:
        nonlocal pos
        try:
            with open(out_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        if chunk:
            pos += len(chunk)
            if not args.quiet:
                stdout.write(chunk)
                stdout.flush()

    try:
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if t_cmd is None and (job / "t_ready").exists():
                t_cmd = time.monotonic()
            pump()
            if time.monotonic() - t0 > args.timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log(f"interrupted; job dir {job}")
        return 130
    pump()
    t_end = time.monotonic()
    if t_cmd is None and (job / "t_ready").exists():
        t_cmd = t_end
    if not rc_path.is_file():
        why = f"timed out after {args.timeout:.0f}s" if timed_out else f"qemu exited {proc.returncode} ({accel})"
        log(f"VM never finished: {why}; console log: {console} (qemu stderr: {job / 'qemu.stderr'})")
        return 125
    rc = int(rc_path.read_text().strip() or 125)
    if args.timing or os.environ.get("SOFTROCE_VM_TIMING"):
        boot = f"{t_cmd - t0:.1f}s" if t_cmd else "?"
        log(f"accel={accel} boot-to-command {boot}, whole cycle {t_end - t0:.1f}s, rc={rc}")
    if args.keep:
        log(f"job dir kept: {job}")
    else:
        shutil.rmtree(job, ignore_errors=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="softroce-vm", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("setup", help="build VM artifacts + .venv-rdma (idempotent)")
    s.add_argument("--force", action="store_true", help="rebuild even if up to date")
    s.add_argument("--vm-only", action="store_true", help="skip the venv")
    s.add_argument("--venv-only", action="store_true", help="skip the VM artifacts")
    s.set_defaults(fn=cmd_setup)
    r = sub.add_parser("run", help="boot the VM and run CMD inside it (exit = CMD's status, 125 = VM failed)")
    r.add_argument("--timeout", type=float, default=float(os.environ.get("VM_TIMEOUT", 900)),
                   help="seconds for the whole VM run (default 900)")
    r.add_argument("--env", action="append", metavar="K=V", help="extra environment for CMD")
    r.add_argument("--keep", action="store_true", help="keep the job dir (console.log, output.log)")
    r.add_argument("--quiet", action="store_true", help="do not print CMD's output")
    r.add_argument("--timing", action="store_true", help="print boot/cycle times to stderr")
    r.add_argument("--netdev", default="dummy", help="rxe netdev: dummy (default) | virtio | none")
    r.add_argument("--mtu", type=int, default=int(os.environ.get("VM_NET_MTU", DEFAULT_NET_MTU)),
                   help=f"netdev MTU (default {DEFAULT_NET_MTU} -> RoCE active_mtu 4096; 1500 -> 1024)")
    r.add_argument("--rw-size", default="50%", help="tmpfs size for the root overlay (default 50%% of RAM)")
    r.add_argument("--tmp-size", default="75%", help="tmpfs size for /tmp (default 75%% of RAM)")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)
    st = sub.add_parser("status", help="show what is built")
    st.set_defaults(fn=cmd_status)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
