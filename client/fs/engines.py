"""Which metadata engine a mount uses, from its URL (the engines themselves: meta_sqlite.py, meta_etcd.py)."""
from __future__ import annotations

from client.fs.meta import Meta


def open_meta(url: str) -> Meta:
    """``sqlite:PATH`` (the embedded default, one mount) or ``etcd://HOST:PORT[/VOLUME]`` (shared)."""
    scheme, _, rest = url.partition(":")
    if scheme == "sqlite" and rest:
        from client.fs.meta_sqlite import SqliteMeta   # imported only when used
        return SqliteMeta(rest)
    if scheme == "etcd" and rest.startswith("//"):
        from client.fs.meta_etcd import EtcdMeta
        return EtcdMeta(url.replace("etcd://", "http://", 1))
    raise ValueError(f"unknown metadata URL {url!r}: use sqlite:PATH or etcd://HOST:PORT[/VOLUME]")
