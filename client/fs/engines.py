"""Which metadata engine a mount uses, from its URL (the engines themselves: meta_sqlite.py, meta_etcd.py)."""
from __future__ import annotations

from client.fs.meta import Meta


def open_meta(url: str, etcd_access=None, inline_max: int | None = None) -> Meta:
    """``sqlite:PATH`` (the embedded default, one mount) or ``etcd://HOST:PORT[/VOLUME]`` (shared; reached
    with ``etcd_access``, a wire.etcdmap.EtcdAccess: its user and client TLS).  ``inline_max``: files up to
    this size keep their bytes in the metadata (SQLite only; None: the engine's default)."""
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite" and rest:
        from client.fs.meta_sqlite import SqliteMeta   # imported only when used
        return SqliteMeta(rest) if inline_max is None else SqliteMeta(rest, inline_max)
    if scheme == "etcd" and rest.startswith("//"):
        from client.fs.meta_etcd import EtcdMeta
        return EtcdMeta(url.replace("etcd://", "http://", 1), access=etcd_access)
    raise ValueError(f"unknown metadata URL {url!r}: use sqlite:PATH or etcd://HOST:PORT[/VOLUME]")
