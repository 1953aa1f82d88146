"""What the cluster map in etcd may hold (wire/mapcheck.py): pure checks, no etcd, no sockets.

A value read from etcd is obeyed only if it is well-formed, carries the MAC of this cluster's secret (when
there is one), and moves a partition's epoch forward by a bounded step adding only registered nodes.
"""
from __future__ import annotations

import json

import pytest
import trio

from wire.etcdmap import Etcd
from wire.mapcheck import (MAP_MAX_EPOCH, MAX_EPOCH_STEP, Invalid, PartView, check_change, map_key, open_entry,
                           seal)

P = "/datanode"
KEY = map_key(b"k" * 32, P)
A, B, C = "10.0.0.1:17310", "10.0.0.2:17310", "10.0.0.3:17310"


def view_body(**kw) -> dict:
    return {"id": 1, "replicas": [A, B, C], "epoch": 4, "want": 3, "synced": [A, B, C], "state": "writable",
            "installed": True, **kw}


def reason(fn, *args) -> str:
    with pytest.raises(Invalid) as e:
        fn(*args)
    return e.value.reason


def test_a_sealed_view_opens_as_written():
    v = open_entry(KEY, P, P + "/parts/1", seal(KEY, P + "/parts/1", view_body()))
    assert v == PartView(1, [A, B, C], 4, want=3, synced=[A, B, C], state="writable", installed=True)


@pytest.mark.parametrize("tamper, why", [
    (lambda raw: raw.replace('"epoch":4', '"epoch":5'), "bad_mac"),        # the value changed
    (lambda raw: json.dumps({k: v for k, v in json.loads(raw).items() if k != "mac"}), "no_mac"),
])
def test_a_changed_or_unsealed_value_is_refused(tamper, why):
    raw = seal(KEY, P + "/parts/1", view_body())
    assert reason(open_entry, KEY, P, P + "/parts/1", tamper(raw)) == why


def test_a_mac_binds_the_key_the_cluster_and_the_secret():
    raw = seal(KEY, P + "/parts/1", view_body())
    # the same value copied to another partition's key (its id is checked too, but the MAC fails first)
    assert reason(open_entry, KEY, P, P + "/parts/2", raw.replace('"id":1', '"id":2')) == "bad_mac"
    # another cluster (prefix) sharing the secret, and another secret, make other keys
    other = map_key(b"k" * 32, "/other")
    assert other != KEY
    assert reason(open_entry, other, "/other", "/other/parts/1", raw) == "bad_mac"
    assert reason(open_entry, KEY, P, "/other/parts/1", raw) == "bad_key"       # not this cluster's key
    assert reason(open_entry, map_key(b"x" * 32, P), P, P + "/parts/1", raw) == "bad_mac"


def test_without_a_secret_there_is_no_mac_but_the_schema_holds():
    raw = seal(None, P + "/parts/1", view_body())
    assert "mac" not in json.loads(raw)
    assert open_entry(None, P, P + "/parts/1", raw).epoch == 4


@pytest.mark.parametrize("body, why", [
    ({"id": 1, "replicas": 7, "epoch": "x"}, "bad_type"),              # what killed the manager
    (view_body(epoch=(1 << 63) - 2), "out_of_range"),                  # next to the header's limit
    (view_body(epoch=True), "bad_type"),
    (view_body(epoch=0), "out_of_range"),
    (view_body(replicas=[]), "out_of_range"),
    (view_body(replicas=[A, A]), "out_of_range"),
    (view_body(replicas=["nohost"]), "bad_address"),
    (view_body(replicas=[A] * 17), "out_of_range"),
    (view_body(synced=["10.9.9.9:1"]), "out_of_range"),
    (view_body(state="mine"), "out_of_range"),
    (view_body(installed="yes"), "bad_type"),
    (view_body(want=99), "out_of_range"),
    (view_body(id=2), "bad_key"),                                      # stored under another partition
])
def test_malformed_views_are_refused(body, why):
    raw = seal(KEY, P + "/parts/1", body)
    assert reason(open_entry, KEY, P, P + "/parts/1", raw) == why


@pytest.mark.parametrize("raw, why", [(b"not json", "not_json"), (b"[1, 2]", "not_an_object"),
                                      (b'"x"' * 400_000, "too_large")])
def test_values_that_are_not_objects_are_refused(raw, why):
    assert reason(open_entry, None, P, P + "/parts/1", raw) == why


def test_node_records_and_requests_are_checked():
    rec = {"addr": A, "zone": "z", "free_bytes": 5, "capacity_bytes": 9,
           "partitions": {"1": {"epoch": 2, "replicas": [A, B]}}}
    assert open_entry(KEY, P, P + f"/nodes/{A}", seal(KEY, P + f"/nodes/{A}", rec))["zone"] == "z"
    assert reason(open_entry, KEY, P, P + f"/nodes/{B}", seal(KEY, P + f"/nodes/{B}", rec)) == "bad_key"
    bad = {**rec, "partitions": {"1": {"epoch": 1 << 62, "replicas": [A]}}}
    assert reason(open_entry, None, P, P + f"/nodes/{A}", json.dumps(bad)) == "out_of_range"
    ok = {"op": "create", "count": 2, "replicas": 3, "state": "pending"}
    assert open_entry(None, P, P + "/requests/r1", json.dumps(ok))["count"] == 2
    for body in ({"op": "rm -rf"}, {**ok, "count": 10 ** 6}, {**ok, "replicas": "3"}):
        with pytest.raises(Invalid):
            open_entry(None, P, P + "/requests/r1", json.dumps(body))
    # a drain mark written without the secret
    assert reason(open_entry, KEY, P, P + f"/drain/{A}", json.dumps({"since": 1.0})) == "no_mac"


def test_an_epoch_moves_forward_by_a_bounded_step_adding_only_registered_nodes():
    v = PartView(1, [A, B], 10)
    check_change(10, [A, B, C], v)                        # a member dropped: the same epoch re-read is fine
    check_change(9, [A, B, C], v, registered={A})         # kept members may be gone (the manager removes them)
    assert reason(check_change, 11, [A, B], v) == "epoch_backwards"
    assert reason(check_change, 10 - MAX_EPOCH_STEP - 1, [A, B], v) == "epoch_jump"
    v2 = PartView(1, ["127.0.0.1:1"], 11)
    assert reason(check_change, 10, [A, B], v2, {A, B}) == "replica_not_registered"
    check_change(10, [A, B], PartView(1, [A, B, C], 11), registered={A, B, C})
    assert MAP_MAX_EPOCH + MAX_EPOCH_STEP < (1 << 63) - 1     # no accepted epoch + a step overflows the header


def test_a_sealed_view_may_add_a_node_whose_lease_lapsed_an_unsealed_one_may_not():
    """The manager chose a spare that was registered then; by the time its sealed view is read back the spare's
    lease may have lapsed.  Everyone holding the secret follows that view (else the manager's own cache and the
    nodes would keep the old one); without a secret only registered nodes may be added."""
    v = PartView(1, [A, B, C], 11)
    sealed = Etcd("http://127.0.0.1:9", admin_key=b"k" * 32)
    unsealed = Etcd("http://127.0.0.1:9")
    assert sealed.follows(10, [A, B], v, registered={A, B})
    assert not unsealed.follows(10, [A, B], v, registered={A, B})
    assert unsealed.invalid == {"replica_not_registered": 1}
    assert not sealed.follows(11 + MAX_EPOCH_STEP, [A, B], v, registered={A, B, C})     # epochs still rule
    # ... so a sealed view costs no read of the registrations (etcd is not reachable here: any read would fail)
    assert trio.run(sealed.registered_for, [A, B], v) is None
    assert trio.run(unsealed.registered_for, [A, B, C], v) is None          # nothing added: nothing to check
