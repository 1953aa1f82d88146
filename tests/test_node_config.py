"""Configuration in one place: a node's keys come from their defaults, node.toml, $DATANODE_<KEY> and the
command line, in that order; the connection keys reach the transport as TransportOptions; a client is given
its credentials and options, and reads the environment only for what it is not given."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest
import trio
from hypothesis import given, strategies as st

from client.sdk import ClientError, DataClient
from datanode import config as config_mod
from wire.auth import Credentials, gen_secret
from wire.protocol import INLINE_MAX
from wire.transport.base import OptionError, TransportOptions

BIN = pathlib.Path(sys.executable).parent


def test_a_key_comes_from_the_command_line_then_the_environment_then_the_file_then_its_default(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('pool_mib = 64\nverbs_inline = 4096\nlisten = "127.0.0.1:1"\n')
    env = {"DATANODE_VERBS_INLINE": "0", "DATANODE_LISTEN": "127.0.0.1:2", "DATANODE_RDMA_WINDOWS": "off",
           "DATANODE_SYNC": "none", "DATANODE_START_TIMEOUT": "90", "HOME": "/root"}
    cfg = config_mod.load(toml, env, listen="127.0.0.1:3", data_dir=None)
    assert (cfg.listen, cfg.verbs_inline, cfg.pool_mib, cfg.rdma_windows, cfg.sync, cfg.data_dir) == \
        ("127.0.0.1:3", 0, 64, False, config_mod.SyncMode.NONE, "./data")
    assert cfg.origin == {"listen": "command line", "verbs_inline": "env DATANODE_VERBS_INLINE",
                          "pool_mib": f"file {toml}", "rdma_windows": "env DATANODE_RDMA_WINDOWS",
                          "sync": "env DATANODE_SYNC"}
    # without an environment given (a tool reading another node's node.toml) none is read
    assert config_mod.load(toml).verbs_inline == 4096
    # a client's credentials in the environment (an admin's shell) are not the node's
    secret = tmp_path / "secret"
    secret.write_text(gen_secret())
    cfg = config_mod.load(None, {"DATANODE_SECRET_FILE": str(secret), "DATANODE_TLS_CA": str(secret)})
    assert (cfg.secret_file, cfg.tls_ca, cfg.origin) == ("", "", {})


@pytest.mark.parametrize("env, words", [
    ({"DATANODE_VERBS_INLINE": "lots"}, ["DATANODE_VERBS_INLINE", "expected int"]),
    ({"DATANODE_VERBS_INLINE": str(INLINE_MAX + 1)}, ["verbs_inline", "DATANODE_VERBS_INLINE", str(INLINE_MAX)]),
    ({"DATANODE_RDMA_WINDOWS": "maybe"}, ["DATANODE_RDMA_WINDOWS", "true/false"]),
    ({"DATANODE_VERBS_POSTERS": "0"}, ["verbs_posters", "between 1 and 64"]),
    ({"DATANODE_TRANSPORT": "carrier-pigeon"}, ["transport", "'tcp'"]),
])
def test_a_bad_value_in_the_environment_is_refused_naming_the_variable(env, words):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(None, env)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_every_transport_option_is_a_node_key_with_the_same_default():
    keys = {f.name for f in dataclasses.fields(config_mod.Config)}
    assert {f.name for f in dataclasses.fields(TransportOptions)} <= keys
    assert config_mod.transport_options(config_mod.Config()) == TransportOptions()
    cfg = config_mod.from_dict({"tcp_congestion": "", "verbs_post_thread_min": 0, "trace": "/tmp/t"})
    assert config_mod.transport_options(cfg) == TransportOptions(tcp_congestion="", verbs_post_thread_min=0,
                                                                 trace="/tmp/t")


_SPELLINGS = {True: ["1", "true", "yes", "on", "ON", " True "], False: ["0", "false", "no", "off", "Off"]}


@st.composite
def options_and_env(draw):
    """Any valid TransportOptions, and an environment that spells each of its fields in one of the accepted
    ways (a field at its default may be left out)."""
    values, env = {}, {"DATANODE_START_TIMEOUT": "90", "PATH": "/bin"}     # not keys: ignored
    for f in dataclasses.fields(TransportOptions):
        default = f.default
        if f.type == "bool":
            v = draw(st.booleans())
            text = draw(st.sampled_from(_SPELLINGS[v]))
        elif f.type == "int":
            lo, hi = {"gid_index": (0, 255), "verbs_inline": (0, INLINE_MAX), "verbs_spin_us": (0, 1_000_000),
                      "verbs_post_thread_min": (-1, 1 << 40), "verbs_posters": (1, 64)}[f.name]
            v = draw(st.integers(lo, hi))
            text = draw(st.sampled_from([str(v), f" {v}\n"]))
        else:
            v = draw(st.text(st.characters(codec="ascii", exclude_characters="\0"), max_size=12))
            text = v
        if v == default and draw(st.booleans()):
            continue
        values[f.name] = v
        env["DATANODE_" + f.name.upper()] = text
    return TransportOptions(**values), env


@given(options_and_env())
def test_the_environment_spells_options_as_a_node_reads_them(case):
    """TransportOptions.from_env (a client's default) and a node's config read the same variables the same way."""
    want, env = case
    assert TransportOptions.from_env(env) == want
    assert config_mod.transport_options(config_mod.load(None, env)) == want


def test_options_out_of_range_name_the_field():
    with pytest.raises(OptionError) as e:
        TransportOptions(verbs_inline=-1)
    assert e.value.key == "verbs_inline"
    with pytest.raises(ValueError, match="DATANODE_VERBS_SPIN_US"):
        TransportOptions.from_env({"DATANODE_VERBS_SPIN_US": "soon"})


def test_print_config_says_where_each_value_came_from(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('pool_mib = 64\n')
    env = {**os.environ, "DATANODE_VERBS_INLINE": "0", "DATANODE_TCP_CONGESTION": ""}
    env.pop("DATANODE_SYNC", None)
    p = subprocess.run([str(BIN / "datanode"), "print-config", "--config", str(toml)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    lines = {ln.split("=")[0].strip(): ln for ln in p.stdout.splitlines() if ln.strip()}
    for key, value, origin in (("pool_mib", "64", f"file {toml}"), ("verbs_inline", "0", "env DATANODE_VERBS_INLINE"),
                               ("tcp_congestion", '""', "env DATANODE_TCP_CONGESTION"),
                               ("sync", '"always"', "default")):
        assert lines[key].startswith(f"{key} = {value} ") and f"({origin})" in lines[key], lines[key]
    env["DATANODE_VERBS_INLINE"] = "lots"
    p = subprocess.run([str(BIN / "datanode"), "print-config"], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "DATANODE_VERBS_INLINE" in p.stderr, p.stderr


def _client(**kw) -> DataClient:
    """A DataClient made (no connection is opened) inside a trio run, for looking at what it was given
    (``from_env``, the default: with the rest from the environment, as ``DataClient.from_env`` makes it)."""
    async def make():
        async with trio.open_nursery() as n:
            try:
                env = kw.pop("from_env", True)
                return DataClient(n, transport="tcp", pool_mib=1, **(DataClient.env_kwargs(**kw) if env else kw))
            except ClientError as e:      # raised below, not wrapped in the nursery's group
                return e
    got = trio.run(make)
    if isinstance(got, ClientError):
        raise got
    return got


def test_a_client_from_env_takes_what_it_is_given_and_reads_the_environment_only_for_the_rest(tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text(gen_secret())
    other = tmp_path / "other"
    other.write_text(gen_secret())
    creds = Credentials.load(secret)
    monkeypatch.setenv("DATANODE_SECRET_FILE", str(other))
    monkeypatch.setenv("DATANODE_TCP_CONGESTION", "reno")
    given = _client(secret=creds, options=TransportOptions())
    assert given.auth.creds is creds and given.domain.options == TransportOptions()
    plain = _client(from_env=False)          # the SDK itself: its arguments only, never the environment
    assert plain.auth.creds is None and plain.domain.options == TransportOptions()
    left = _client()
    assert left.auth.creds.source == str(other) and left.domain.options.tcp_congestion == "reno"
    monkeypatch.setenv("DATANODE_TLS_CA", str(tmp_path / "no-such-ca.pem"))
    with pytest.raises(ClientError, match="no-such-ca"):
        _client()
    monkeypatch.delenv("DATANODE_TLS_CA")
    monkeypatch.setenv("DATANODE_VERBS_POSTERS", "many")
    with pytest.raises(ClientError, match="DATANODE_VERBS_POSTERS"):
        _client(secret=creds)


def test_each_key_is_in_one_section_and_the_docs_table_is_made_from_the_declarations():
    """Config is the union of its sections: a key declared in two of them would silently be one key."""
    per_section = [f.name for s in config_mod.SECTIONS for f in dataclasses.fields(s)]
    assert sorted(per_section) == sorted(f.name for f in dataclasses.fields(config_mod.Config))
    for f in dataclasses.fields(config_mod.Config):
        assert f.metadata["key"].help and f.metadata["key"].unit, f.name
    docs = (pathlib.Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    assert config_mod.with_table(docs) == docs, \
        "docs/operations.md's key table is not the declarations': python -m datanode.config --write docs/operations.md"
    p = subprocess.run([sys.executable, "-m", "datanode.config", "--markdown"], capture_output=True, text=True,
                       timeout=60, cwd=pathlib.Path(__file__).parent.parent)
    assert p.returncode == 0 and p.stdout == config_mod.markdown(), p.stderr


def test_print_config_groups_the_keys_by_section():
    text = config_mod.to_toml(config_mod.Config(), annotate=True)
    titles = [ln for ln in text.splitlines() if ln.startswith("# -- ")]
    assert len(titles) == len(config_mod.SECTIONS)
    order = [ln.split(" = ")[0] for ln in text.splitlines() if " = " in ln and not ln.startswith("#")]
    assert order.index("slots") < order.index("pool_mib") < order.index("sync") < order.index("etcd")
