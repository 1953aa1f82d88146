"""What the cluster map in etcd may hold, checked in one place: pure functions, no I/O.

Whoever can write to etcd could otherwise steer the cluster: move a partition's replicas so that every node
drops its copy, name a leader of its own, or crash a manager with a value of the wrong type.  So every value
read under the cluster's prefix passes ``open_entry`` before anyone acts on it, and an entry that fails is
*ignored* (the caller logs and counts it, wire/etcdmap.py), never obeyed and never fatal:

* **schema**: JSON objects of the expected fields and types, ids and epochs in range, replicas distinct
  ``HOST:PORT`` addresses (at most ``MAX_REPLICAS``), ``synced`` a subset of them, a known ``state``;
* **MAC** (with a cluster secret): every entry a component writes -- partition views (the manager), node
  registrations and hand-off requests (the datanodes), admins' requests and drain marks (dnctl) -- carries ``mac``, an
  HMAC-SHA256 over the key and the rest of the value under ``map_key``, a key derived from the cluster's
  ``admin`` role key and the cluster's prefix.  A peer that can write etcd but holds neither the secret nor
  an admin key cannot make one, so it moves nothing.  Without a secret there is no MAC (docs/security.md);
* **change** (``check_change``): against the view the reader already holds, an epoch never goes back and
  moves forward by at most ``MAX_EPOCH_STEP``; in an unsealed map a replica a view adds must be a registered
  node (a sealed view's additions were chosen by the manager, maybe from a node whose lease lapsed since).

A replay of an older, correctly MAC'd value of the same key is possible for a writer without the secret;
the epoch rule makes it harmless: nobody installs a lower epoch, and a replayed value of the current epoch
repeats a step already taken.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

from .protocol import MAX_REPLICAS, BodyError, check_address, decode_volume

STATES = ("writable", "degraded", "recovering", "read_only")
MAC_FIELD = "mac"
# No real cluster comes near these; a value beyond them is garbage (or an attack) whatever its MAC.
MAP_MAX_EPOCH = 1 << 48          # far below the header's 2^63 - 1, so epoch + 1 never overflows anywhere
MAX_EPOCH_STEP = 1024            # one membership change is one epoch; a node away for 1024 of them has no say
MAX_PARTITION_ID = (1 << 62)
MAX_VALUE_BYTES = 1 << 20        # a registration with thousands of partitions is far below this
REQUEST_OPS = ("create",)
REQUEST_STATES = ("pending", "done", "failed")


class Invalid(ValueError):
    """An etcd value that must be ignored: ``reason`` is a short code (a metrics label), the text says why."""

    def __init__(self, reason: str, text: str):
        super().__init__(text)
        self.reason = reason


@dataclasses.dataclass
class PartView:
    """One partition as the cluster map has it."""
    id: int
    replicas: list[str]
    epoch: int
    want: int = 0                 # replica count it should have (0: len(replicas) at adoption)
    synced: list[str] = dataclasses.field(default_factory=list)
    state: str = "writable"
    installed: bool = True
    rev: int = 0                  # etcd mod revision this view was read at (not stored)

    @property
    def leader(self) -> str:
        return self.replicas[0]

    def under(self, live=None) -> bool:
        """Below its replica count: fewer replicas than ``want`` that are ``synced`` (and registered, when the
        set of ``live`` nodes is given) -- one lost, one still being filled, one whose node is gone."""
        ok = [r for r in self.replicas if r in self.synced and (live is None or r in live)]
        return len(ok) < (self.want or len(self.replicas))

    def body(self) -> dict:
        """What is stored in etcd (``seal`` it before writing)."""
        d = dataclasses.asdict(self)
        d.pop("rev")
        return d

    def to_dict(self) -> dict:
        return {"id": self.id, "replicas": self.replicas, "leader": self.leader, "epoch": self.epoch,
                "want": self.want, "synced": self.synced, "state": self.state, "installed": self.installed}


# -- MAC -----------------------------------------------------------------------------------------------
def map_key(admin_key: bytes, prefix: str) -> bytes:
    """The key of every map entry's MAC: per cluster (its prefix), derived from the ``admin`` role key (so
    the manager may run with an admin key file instead of the secret; a client key cannot make it)."""
    return hmac.new(admin_key, b"datanode map mac v1|" + prefix.encode(), hashlib.sha256).digest()


def _canonical(d: dict) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _mac(mac_key: bytes, key: str, text: str) -> str:
    return hmac.new(mac_key, key.encode() + b"\0" + text.encode(), hashlib.sha256).hexdigest()


def seal(mac_key: bytes | None, key: str, body: dict) -> str:
    """The value to store at ``key``: ``body`` as JSON, with ``mac`` over the key and the body when there is a
    MAC key."""
    body = {k: v for k, v in body.items() if k != MAC_FIELD}
    if mac_key is None:
        return _canonical(body)
    return _canonical({**body, MAC_FIELD: _mac(mac_key, key, _canonical(body))})


def unseal(mac_key: bytes | None, key: str, raw: bytes | str) -> dict:
    """The JSON object stored at ``key``, its MAC checked when there is a MAC key (Invalid otherwise)."""
    if len(raw) > MAX_VALUE_BYTES:
        raise Invalid("too_large", f"{len(raw)} bytes, at most {MAX_VALUE_BYTES}")
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Invalid("not_json", "not JSON") from None
    if not isinstance(d, dict):
        raise Invalid("not_an_object", f"a JSON {type(d).__name__}, not an object")
    mac = d.pop(MAC_FIELD, None)
    if mac_key is None:
        return d
    if not isinstance(mac, str):
        raise Invalid("no_mac", "no MAC (written without the cluster secret)")
    if not hmac.compare_digest(mac, _mac(mac_key, key, _canonical(d))):
        raise Invalid("bad_mac", "its MAC does not verify (written without this cluster's secret, or altered)")
    return d


# -- schema --------------------------------------------------------------------------------------------
def _int(d: dict, name: str, lo: int, hi: int, default=None) -> int:
    v = d.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise Invalid("bad_type", f"{name!r} must be an integer, got {v!r:.40}")
    if not lo <= v <= hi:
        raise Invalid("out_of_range", f"{name!r} must be in {lo}..{hi}, got {v}")
    return v


def _addrs(v, name: str, *, empty_ok: bool) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise Invalid("bad_type", f"{name!r} must be a list of HOST:PORT strings, got {v!r:.60}")
    if not v and not empty_ok:
        raise Invalid("out_of_range", f"{name!r} is empty")
    if len(v) > MAX_REPLICAS or len(set(v)) != len(v):
        raise Invalid("out_of_range", f"{name!r} must name at most {MAX_REPLICAS} distinct nodes")
    for a in v:
        try:
            check_address(a)
        except BodyError:
            raise Invalid("bad_address", f"{name!r}: {a!r:.60} is not HOST:PORT") from None
    return list(v)


def check_view(pid_text: str, d: dict) -> PartView:
    """A partition view stored at ``parts/<pid_text>``."""
    if not pid_text.isdigit() or str(int(pid_text)) != pid_text:
        raise Invalid("bad_key", f"partition key {pid_text!r:.40} is not a partition id")
    pid = _int(d, "id", 1, MAX_PARTITION_ID)
    if pid != int(pid_text):
        raise Invalid("bad_key", f"the view of partition {pid} is stored under partition {pid_text}")
    replicas = _addrs(d.get("replicas"), "replicas", empty_ok=False)
    synced = _addrs(d.get("synced", []), "synced", empty_ok=True)
    if any(a not in replicas for a in synced):
        raise Invalid("out_of_range", "'synced' names a node that is not a replica")
    state, installed = d.get("state", "writable"), d.get("installed", True)
    if state not in STATES:
        raise Invalid("out_of_range", f"'state' must be one of {', '.join(STATES)}, got {state!r:.40}")
    if not isinstance(installed, bool):
        raise Invalid("bad_type", f"'installed' must be true or false, got {installed!r:.40}")
    return PartView(pid, replicas, _int(d, "epoch", 1, MAP_MAX_EPOCH), want=_int(d, "want", 0, MAX_REPLICAS, 0),
                    synced=synced, state=state, installed=installed)


def check_change(old_epoch: int, old_replicas: list[str], new: PartView, registered=None) -> None:
    """``new`` may follow a view of ``old_epoch`` with ``old_replicas`` that the reader holds: its epoch is not
    lower and at most ``MAX_EPOCH_STEP`` higher, and (``registered``: the addresses of registered nodes) every
    replica it adds is registered.  Replicas it keeps may be gone: the manager removes them itself."""
    if new.epoch < old_epoch:
        raise Invalid("epoch_backwards", f"epoch {new.epoch} is below the {old_epoch} already known")
    if new.epoch - old_epoch > MAX_EPOCH_STEP:
        raise Invalid("epoch_jump", f"epoch {new.epoch} jumps more than {MAX_EPOCH_STEP} past {old_epoch}")
    if registered is not None:
        strangers = [a for a in new.replicas if a not in old_replicas and a not in registered]
        if strangers:
            raise Invalid("replica_not_registered", f"adds {', '.join(strangers)}, not a registered node")


def check_node(addr: str, d: dict) -> dict:
    """A node's registration stored at ``nodes/<addr>`` (addr, pid, transport, zone, bytes, partitions)."""
    try:
        check_address(addr)
    except BodyError:
        raise Invalid("bad_key", f"node key {addr!r:.60} is not HOST:PORT") from None
    if d.get("addr", addr) != addr:
        raise Invalid("bad_key", f"the registration of {d.get('addr')!r:.60} is stored under {addr}")
    for name in ("capacity_bytes", "free_bytes"):
        _int(d, name, 0, 1 << 62, 0)
    for name in ("transport", "zone"):
        if not isinstance(d.get(name, ""), str):
            raise Invalid("bad_type", f"{name!r} must be a string")
    parts = d.get("partitions", {})
    if not isinstance(parts, dict):
        raise Invalid("bad_type", "'partitions' must be an object")
    for pid, pv in parts.items():
        if not pid.isdigit() or not 1 <= int(pid) <= MAX_PARTITION_ID or not isinstance(pv, dict):
            raise Invalid("bad_type", f"partition {pid!r:.40} of the registration is not an id with a view")
        _int(pv, "epoch", 1, MAP_MAX_EPOCH)
        _addrs(pv.get("replicas"), "replicas", empty_ok=False)
    return d


def check_request(d: dict) -> dict:
    """An admin's request to the manager (``requests/<id>``; manager/tasks.py)."""
    if d.get("op") not in REQUEST_OPS or d.get("state", "pending") not in REQUEST_STATES:
        raise Invalid("out_of_range", f"not a request: op {d.get('op')!r:.40}, state {d.get('state')!r:.40}")
    if d.get("state", "pending") == "pending":
        _int(d, "count", 1, 4096)
        _int(d, "replicas", 1, MAX_REPLICAS)
        try:
            decode_volume(d)           # the volume the new partitions belong to (optional)
        except BodyError as e:
            raise Invalid("out_of_range", e.detail) from None
    return d


def check_handoff(addr: str, d: dict) -> dict:
    """A stopping node's request to move its partitions off it (``handoff/<addr>``; datanode/drain.py)."""
    try:
        check_address(addr)
    except BodyError:
        raise Invalid("bad_key", f"hand-off key {addr!r:.60} is not HOST:PORT") from None
    _int(d, "pid", 0, 1 << 32, 0)
    if not isinstance(d.get("since", 0), (int, float)):
        raise Invalid("bad_type", "'since' must be a number")
    return d


SEALED = ("nodes", "parts", "requests", "drain", "handoff")   # the subtrees whose entries carry a MAC


def kind_of(prefix: str, key: str) -> tuple[str, str] | None:
    """(subtree, name) of a key of the cluster (``("parts", "7")``), None for a key outside the sealed
    subtrees (the manager's election key, another cluster's prefix)."""
    root = prefix.rstrip("/") + "/"
    if not key.startswith(root):
        return None
    kind, sep, name = key[len(root):].partition("/")
    return (kind, name) if sep and kind in SEALED else None


def open_entry(mac_key: bytes | None, prefix: str, key: str, raw: bytes | str):
    """The checked content of a sealed entry: a PartView (``parts/``), else the object (a node's
    registration, a request, a drain mark).  Invalid when it must be ignored."""
    kind = kind_of(prefix, key)
    if kind is None:
        raise Invalid("bad_key", f"{key!r:.80} is not a key of this cluster's map")
    body = unseal(mac_key, key, raw)
    if kind[0] == "parts":
        return check_view(kind[1], body)
    if kind[0] == "nodes":
        return check_node(kind[1], body)
    if kind[0] == "requests":
        return check_request(body)
    if kind[0] == "handoff":
        return check_handoff(kind[1], body)
    return body
