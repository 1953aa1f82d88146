"""Does the RDMA device support memory windows (type 1 / type 2)?  Run in the Soft-RoCE VM:

    lab/softroce-vm run -- python -m bench.mw_probe

Prints the device's MW capability bits, then tries to register an MR that allows MW binding and to
allocate a type-1 and a type-2 window on it.  (Binding per request would scope a peer's one-sided access to
one request's buffer: the datanode does, see docs/security.md and wire/transport/verbs.py.)
"""
from __future__ import annotations

import os
import sys

import pyverbs.enums as e
from pyverbs.device import Context
from pyverbs.pd import PD

DEV = os.environ.get("DATANODE_RDMA_DEVICE", "rxe0")


def main() -> int:
    ctx = Context(name=DEV)
    attr = ctx.query_device()
    caps = attr.device_cap_flags
    print(f"device {DEV}: device_cap_flags={caps:#x}")
    for name in ("IBV_DEVICE_MEM_WINDOW", "IBV_DEVICE_MEM_WINDOW_TYPE_2A", "IBV_DEVICE_MEM_WINDOW_TYPE_2B"):
        bit = getattr(e, name, None)
        print(f"  {name}: {'yes' if bit is not None and caps & bit else 'no'}")
    print(f"  max_mw: {getattr(attr, 'max_mw', '?')}")
    pd = PD(ctx)
    ok = True
    try:
        from pyverbs.mr import MR, MW
        mr = MR(pd, 1 << 20, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_MW_BIND)
        print(f"MR with MW_BIND access: ok (rkey {mr.rkey:#x})")
        for t, name in ((e.IBV_MW_TYPE_1, "type 1"), (e.IBV_MW_TYPE_2, "type 2")):
            try:
                mw = MW(pd, t)
                print(f"alloc MW {name}: ok (rkey {mw.rkey:#x})")
                mw.close()
            except Exception as ex:  # noqa: BLE001 - reporting the device's answer
                ok = False
                print(f"alloc MW {name}: FAILED ({ex})")
        mr.close()
    except Exception as ex:  # noqa: BLE001
        ok = False
        print(f"MR with MW_BIND: FAILED ({ex})")
    pd.close()
    ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
