"""The product as an operator installs it: the built wheel in a fresh venv, run with no checkout around.

One wheel and one venv serve the module (dependencies come from the package index, or pip's cache).  Every
command runs from a working directory that holds decoy packages named like ours, with PYTHONPATH unset, so
code that came from a checkout instead of the wheel fails loudly.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

PACKAGES = {"wire", "datanode", "manager", "client", "tools"}
COMMANDS = {"datanode", "dnmanager", "dnctl", "dnfs"}
UNREACHABLE = ("No matching distribution", "Could not find a version", "Failed to establish a new connection",
               "Temporary failure in name resolution")


class Installed:
    def __init__(self, root: pathlib.Path, wheel: pathlib.Path):
        self.root, self.wheel = root, wheel
        self.venv = root / "venv"
        self.cwd = root / "work"

    def env(self, path: str | None = None) -> dict:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NOTIFY_SOCKET")}
        outside = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(REPO))]
        env["PATH"] = path if path is not None else os.pathsep.join([str(self.venv / "bin"), *outside])
        return env

    def run(self, cmd: str, *args, path: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.venv / "bin" / cmd), *map(str, args)], cwd=self.cwd, env=self.env(path),
                              capture_output=True, text=True, timeout=timeout)

    def ok(self, cmd: str, *args, **kw) -> str:
        r = self.run(cmd, *args, **kw)
        assert r.returncode == 0, f"{cmd} {' '.join(map(str, args))} failed ({r.returncode}): {r.stdout}{r.stderr}"
        return r.stdout


def _source_copy(dst: pathlib.Path) -> None:
    """The checkout's files (tracked, and new ones not ignored) without its venv and build output: setuptools
    writes build/ and *.egg-info next to the sources it builds."""
    r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True)
    if r.returncode != 0:
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "run",
                                                                 "__pycache__", ".pytest_cache", ".hypothesis"))
        return
    for rel in filter(None, r.stdout.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _pip(*args) -> subprocess.CompletedProcess:
    # without PYTHONPATH (conftest points it at the checkout): pip would take the checkout for an installed copy
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([*args], capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0 and any(s in r.stderr for s in UNREACHABLE):
        pytest.skip(f"the package index is out of reach: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, f"{' '.join(map(str, args))} failed: {r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("install")
    src, wheels = root / "src", root / "wheels"
    _source_copy(src)
    _pip(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, src)
    wheel = next(wheels.glob("datanode-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", root / "venv"], check=True, timeout=300)
    _pip(root / "venv" / "bin" / "python", "-m", "pip", "install", "-q", wheel)
    shutil.rmtree(src)
    inst = Installed(root, wheel)
    for pkg in PACKAGES:
        (inst.cwd / pkg).mkdir(parents=True)
        (inst.cwd / pkg / "__init__.py").write_text(
            f"raise ImportError('{pkg} was imported from the working directory, not the installed wheel')\n")
    return inst


def test_the_wheel_holds_the_product_and_its_commands(installed):
    with zipfile.ZipFile(installed.wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        meta = next(t for t in tops if t.endswith(".dist-info"))
        scripts = z.read(f"{meta}/entry_points.txt").decode()
    assert tops - {meta} == PACKAGES            # no lab/, bench/, tests/
    assert {line.split(" = ")[0] for line in scripts.splitlines() if " = " in line} == COMMANDS


def test_every_command_runs_from_the_venv(installed):
    version = installed.wheel.name.split("-")[1]
    for cmd in ("datanode", "dnctl", "dnfs"):
        assert installed.ok(cmd, "--version").strip() == f"{cmd}, version {version}"
    assert "Usage: dnmanager" in installed.ok("dnmanager", "--help")


def test_missing_system_packages_are_named_in_one_line(installed, tmp_path):
    only_venv = str(installed.venv / "bin")          # no etcd, no fusermount3 on this PATH
    r = installed.run("dnctl", "cluster", "up", "--nodes", "1", "--cluster", tmp_path / "c", path=only_venv)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "etcd-server" in r.stderr
    (tmp_path / "mnt").mkdir()
    r = installed.run("dnfs", "mount", "--node", "127.0.0.1:1", "--meta", f"sqlite:{tmp_path / 'm.db'}",
                      tmp_path / "mnt", path=only_venv)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "fuse3" in r.stderr


def test_the_example_node_toml_is_a_valid_config(installed, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(installed.ok("datanode", "gen-secret"))
    example = (REPO / "deploy" / "etc" / "datanode" / "node.toml").read_text()
    conf = tmp_path / "node.toml"
    conf.write_text(example.replace('"/etc/datanode/secret"', json.dumps(str(secret))))
    out = installed.ok("datanode", "print-config", "--config", conf)
    assert 'listen = "10.0.0.11:17310"' in out and 'data_dir = "/var/lib/datanode"' in out


def test_the_units_load(installed, tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze")
    units = []
    for unit in sorted((REPO / "deploy").glob("*.service")):
        units.append(tmp_path / unit.name)        # the commands as installed here instead of /opt/datanode
        units[-1].write_text(unit.read_text().replace("/opt/datanode/bin/", f"{installed.venv}/bin/"))
    r = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if ".service" in ln]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def test_a_three_node_cluster_from_the_installed_wheel(installed, tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("no etcd on PATH (Debian: etcd-server)")
    root = tmp_path / "cluster"
    up = json.loads(installed.ok("dnctl", "cluster", "up", "--nodes", "3", "--cluster", root, "--json"))
    try:
        for proc in up["nodes"] + up["managers"]:
            argv0 = pathlib.Path(f"/proc/{proc['pid']}/cmdline").read_bytes().split(b"\0")[0].decode()
            assert argv0.startswith(str(installed.venv)), argv0
        replicas = next(p["replicas"] for p in up["partitions"] if p["id"] == 1)
        assert len(replicas) == 3
        data = os.urandom((1 << 20) + 4321)
        (tmp_path / "in.bin").write_bytes(data)
        put = json.loads(installed.ok("dnctl", "put", "--cluster", root, "--partition", 1, tmp_path / "in.bin",
                                      "--json"))
        for replica in replicas:
            got = b""
            for loc in put["locations"]:
                out = tmp_path / "out.bin"
                installed.ok("dnctl", "get", "--cluster", root, "--partition", 1, "--extent", loc["extent"],
                             "--offset", loc["offset"], "--length", loc["length"], "--replica", replica,
                             "--out", out)
                got += out.read_bytes()
            assert got == data, f"{replica} returned different bytes"
    finally:
        down = installed.run("dnctl", "cluster", "down", "--cluster", root, "--json")
    assert down.returncode == 0, down.stderr
    assert all(n["result"] == "stopped" for n in json.loads(down.stdout))
