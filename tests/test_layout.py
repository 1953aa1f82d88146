"""The shape of the code, checked: imports run one way (CLI -> admin library -> SDK -> datanode) with no
cycle in tools/ or client/ (import-linter's `lint-imports`, contracts in pyproject.toml), no module imports
another module's private names, no class grows past ``MAX_CLASS_LINES``, the node hands its parts narrow
interfaces (never itself), every dnctl command is defined exactly once, and every entry point of tools/ is a
click command that answers --help."""
from __future__ import annotations

import ast
import collections
import pathlib
import shutil
import subprocess
import sys

import click
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "datanode", "manager", "client", "tools", "lab")
MAX_CLASS_LINES = 600      # past this a class does several things: split it


def _sources():
    for pkg in PACKAGES:
        yield from sorted((REPO / pkg).rglob("*.py"))


def test_lint_imports_contracts_kept():
    exe = pathlib.Path(sys.executable).parent / "lint-imports"
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    p = subprocess.run(cmd + ["--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    contracts = (REPO / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert "0 broken" in p.stdout and f"{contracts} kept" in p.stdout, p.stdout


def test_no_private_names_imported_across_modules():
    bad = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}")
    assert not bad, "\n".join(bad)


def test_no_class_is_longer_than_the_limit():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(REPO)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def test_the_node_hands_its_parts_narrow_interfaces_not_itself():
    """datanode/server.py passes ``self`` (the whole Node) to no component, and the parts it used to be
    passed to (the stop sequence, the metrics, the etcd agent) reach into no ``node``."""
    server = ast.parse((REPO / "datanode" / "server.py").read_text())
    handed = [node.lineno for node in ast.walk(server) if isinstance(node, ast.Call)
              and not (isinstance(node.func, ast.Attribute) and node.func.attr == "started")   # to its starter
              for arg in [*node.args, *(k.value for k in node.keywords)]
              if isinstance(arg, ast.Name) and arg.id == "self"]
    assert not handed, f"datanode/server.py hands self to a component at line(s) {handed}"
    for name in ("drain.py", "metrics.py", "etcdagent.py"):
        tree = ast.parse((REPO / "datanode" / name).read_text())
        reach = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and (isinstance(node.value, ast.Name) and node.value.id == "node" or node.attr == "node")]
        assert not reach, f"datanode/{name} reaches into the node at line(s) {reach}"


def test_every_dnctl_command_is_defined_once():
    """Each (group, name) is declared by exactly one decorator or add_command in tools/, and the live
    command tree has no name bound to two different functions."""
    seen = collections.defaultdict(list)
    for path in sorted((REPO / "tools").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                            and dec.func.attr in ("command", "group") and isinstance(dec.func.value, ast.Name)
                            and dec.func.value.id != "click"):       # @click.command: a top-level entry point
                        name = (dec.args[0].value if dec.args and isinstance(dec.args[0], ast.Constant)
                                else node.name.replace("_", "-"))
                        seen[(dec.func.value.id, name)].append(f"{path.name}:{node.lineno}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_command"
                    and isinstance(node.func.value, ast.Name) and len(node.args) == 2
                    and isinstance(node.args[1], ast.Constant)):
                seen[(node.func.value.id, node.args[1].value)].append(f"{path.name}:{node.lineno}")
    dup = {k: v for k, v in seen.items() if len(v) > 1}
    assert not dup, dup

    from tools.dnctl import main
    callbacks = collections.Counter()

    def walk(group: click.Group):
        for cmd in group.commands.values():
            if isinstance(cmd, click.Group):
                walk(cmd)
            else:
                callbacks[cmd.callback] += 1
    walk(main)
    assert all(n == 1 for n in callbacks.values())
    assert set(main.commands["replica"].commands) == {"add", "remove", "repair"}
    assert {"set-leader", "scrub", "health", "list", "show"} <= set(main.commands["partition"].commands)


@pytest.mark.parametrize("module", ["tools.dnctl", "tools.bench", "datanode.cli", "manager.cli", "client.fs.cli",
                                    "lab", "lab.torture"])
def test_entry_points_are_click_commands(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Usage:") and "-h, --help" in p.stdout and not p.stderr
