"""CRC32C (Castagnoli) for the data path.

``crc32c(data, value=0)`` takes any C-contiguous buffer (bytes, bytearray, memoryview, mmap, ...) and
continues from ``value``, the CRC of everything before it, so ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

The hot path uses the ``crc32c`` package (SSE4.2 / ARMv8 CRC instructions; it releases the GIL for large
buffers).  If that package cannot be imported we fall back to ``crcmod``'s predefined ``crc-32c``, whose
function takes the *previous CRC result* as its second argument (crcmod folds the initial value and the
final xor into it), so the incremental form is the same: ``fun(b, fun(a)) == fun(a + b)`` and the
empty-prefix value is 0.  ``BACKEND`` names the implementation in use ("crc32c" or "crcmod").

``crc32c_combine(crc_a, crc_b, len_b)`` returns ``crc32c(a + b)`` from the two CRCs and ``len(b)`` without
touching the data (GF(2) shift operators for power-of-two lengths, as 4x256 lookup tables built on first
use).  The store uses it to get per-block CRCs and the CRC of a whole range in one pass over the bytes.

``measure_gibps()`` times a CRC function on an in-memory buffer.

Where the CPU's CRC instruction is emulated (it runs far below hardware speed: qemu without KVM), the
package's software tables are faster: ``use_fastest()``, called by a program at its start (the datanode's
``serve``), times both and switches to them (``CHOICE`` says which and why; ``BACKEND`` is then
"crc32c-sw").  Importing this module times nothing and changes nothing.  Setting ``CRC32C_SW_MODE`` (the
package's own switch) picks without a probe.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

__all__ = ["crc32c", "crc32c_combine", "crc32c_shift", "BACKEND", "CHOICE", "HARDWARE", "crcmod_crc32c",
           "hw_crc32c", "measure_gibps", "pick_faster", "use_fastest"]


def _as_bytes_view(data):
    """A 1-D unsigned-byte view of ``data`` (crcmod's C extension wants a plain byte buffer)."""
    if isinstance(data, (bytes, bytearray)):
        return data
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format not in ("B", "b", "c") or mv.ndim != 1:
        mv = mv.cast("B")   # raises TypeError for non-contiguous buffers, like the hardware backend
    return mv


def _make_crcmod() -> Callable:
    import crcmod.predefined

    fun = crcmod.predefined.mkCrcFun("crc-32c")

    def crcmod_crc32c(data, value: int = 0) -> int:
        # crcmod's ``crc`` argument is a previous *result* (init/xorout already folded in), so passing
        # the running CRC straight through is the correct incremental form; 0 is the empty prefix.
        return fun(_as_bytes_view(data), value & 0xFFFFFFFF)

    return crcmod_crc32c


# A CRC instruction the CPU runs itself is many GiB/s; one much slower is emulated (e.g. qemu's TCG, as in
# our Soft-RoCE VM), where the package's own software tables beat it
HW_FAST_GIBPS = 4.0
_PROBE = 256 << 10


def _gibps(fn, buf) -> float:
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        fn(buf)
        dt = time.perf_counter() - t0
        best = dt if best is None or dt < best else best
    return len(buf) / max(best, 1e-9) / (1 << 30)


def _software_twin(pkg) -> Callable | None:
    """The ``crc32c`` package's software implementation beside its hardware one: a second instance of its
    extension, initialised with the package's own switch ``CRC32C_SW_MODE=force``.  None where that cannot
    be done (another build of the package) or does not give the software tables."""
    import importlib.machinery
    import importlib.util
    path = getattr(getattr(pkg, "_crc32c", None), "__file__", None)
    if not path:
        return None
    name = "datanode._crc32c_software._crc32c"      # an extension's init function is named after the last part
    old = os.environ.get("CRC32C_SW_MODE")
    os.environ["CRC32C_SW_MODE"] = "force"
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
        loader.exec_module(mod)
    except Exception:            # noqa: BLE001 - any failure: keep the hardware function
        return None
    finally:
        if old is None:
            del os.environ["CRC32C_SW_MODE"]
        else:
            os.environ["CRC32C_SW_MODE"] = old
    fn = getattr(mod, "crc32c", None)
    if getattr(mod, "hardware_based", True) or fn is None or fn(b"123456789") != 0xE3069283:
        return None
    return fn


def pick_faster(hw: Callable, load_software: Callable[[], Callable | None]) -> tuple[Callable, str]:
    """``hw``, unless it runs slower than real hardware would and the software tables (``load_software()``)
    are at least 1.5x faster on this CPU; returns the function and why it was picked."""
    buf = os.urandom(_PROBE)
    hw_rate = _gibps(hw, buf)
    if hw_rate >= HW_FAST_GIBPS:
        return hw, f"the CPU's CRC instruction ({hw_rate:.1f} GiB/s)"
    sw = load_software()
    if sw is None:
        return hw, f"the CPU's CRC instruction ({hw_rate:.2f} GiB/s; no software tables to compare)"
    sw_rate = _gibps(sw, buf)
    if sw_rate >= 1.5 * hw_rate:
        return sw, (f"software tables ({sw_rate:.2f} GiB/s): the CPU's CRC instruction runs at only "
                    f"{hw_rate:.2f} GiB/s here (emulated?)")
    return hw, f"the CPU's CRC instruction ({hw_rate:.2f} GiB/s; software tables {sw_rate:.2f})"


try:
    import crc32c as _crc32c_pkg

    hw_crc32c = _crc32c_pkg.crc32c          # the C function itself: (data, value=0, gil_release_mode=-1)
    crc32c = hw_crc32c                      # (the package obeys CRC32C_SW_MODE set by the user)
    BACKEND = "crc32c"
    HARDWARE = bool(getattr(_crc32c_pkg, "hardware_based", False))
    CHOICE = "the crc32c package (" + ("the CPU's CRC instruction)" if HARDWARE else "software tables)")
except ImportError:  # pragma: no cover - exercised by a subprocess test
    _crc32c_pkg = None
    hw_crc32c = None  # type: ignore[assignment]
    crc32c = _make_crcmod()
    BACKEND = "crcmod"
    HARDWARE = False
    CHOICE = "crcmod (the crc32c package is not installed)"


def use_fastest() -> str:
    """Where the CPU's CRC instruction is emulated, switch ``crc32c`` to the package's software tables
    (``pick_faster``); returns ``CHOICE``.  A program calls it at its start, if at all (the datanode's
    ``serve`` does): it times the CRC (a few ms) and loads a second copy of the package's extension, which
    sets ``CRC32C_SW_MODE`` in ``os.environ`` while it loads -- nothing a library may do when imported.
    Modules that took ``crc32c`` (``from wire.crc import crc32c``) before the call keep the function they
    got: call it before importing them.  With ``CRC32C_SW_MODE`` set by the user it does nothing."""
    global crc32c, BACKEND, HARDWARE, CHOICE
    if hw_crc32c is None or not HARDWARE or crc32c is not hw_crc32c or "CRC32C_SW_MODE" in os.environ:
        return CHOICE
    fn, CHOICE = pick_faster(hw_crc32c, lambda: _software_twin(_crc32c_pkg))
    if fn is not hw_crc32c:
        crc32c, BACKEND, HARDWARE = fn, "crc32c-sw", False
    return CHOICE


def crcmod_crc32c(data, value: int = 0) -> int:
    """The crcmod implementation, whatever BACKEND is (test oracle / benchmarks)."""
    global _crcmod_fun
    if _crcmod_fun is None:
        _crcmod_fun = _make_crcmod()
    return _crcmod_fun(data, value)


_crcmod_fun = None if BACKEND != "crcmod" else crc32c


# ---------------------------------------------------------------------------------------------------------
# combine: crc32c(a + b) == shift(crc32c(a), len(b)) ^ crc32c(b), where shift(x, n) multiplies the CRC
# register by x^(8n) mod P.  (Pre/post inversion cancels: crc(d, v) ^ crc(d, 0) == shift(v, len(d)).)

_POLY = 0x82F63B78  # reflected Castagnoli polynomial
_tables: list[tuple[list[int], list[int], list[int], list[int]]] = []   # _tables[k]: shift by 2**k bytes
_tables_lock = threading.Lock()


def _apply_cols(cols: list[int], x: int) -> int:
    r = 0
    i = 0
    while x:
        if x & 1:
            r ^= cols[i]
        x >>= 1
        i += 1
    return r


def _cols_to_tables(cols: list[int]):
    tabs = []
    for j in range(4):
        c = cols[8 * j:8 * j + 8]
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ c[low.bit_length() - 1]
        tabs.append(t)
    return tuple(tabs)


def _tables_upto(k: int):
    if len(_tables) > k:
        return _tables
    with _tables_lock:
        if not _tables:
            cols = []                       # one zero byte: eight one-bit shifts
            for i in range(32):
                x = 1 << i
                for _ in range(8):
                    x = (x >> 1) ^ (_POLY if x & 1 else 0)
                cols.append(x)
            _tables.append(_cols_to_tables(cols) + (cols,))
        while len(_tables) <= k:
            prev = _tables[-1][4]
            cols = [_apply_cols(prev, c) for c in prev]   # square the operator
            _tables.append(_cols_to_tables(cols) + (cols,))
    return _tables


def crc32c_shift(value: int, length: int) -> int:
    """The CRC register ``value`` advanced over ``length`` zero bytes, without the pre/post inversion."""
    if length <= 0 or not value:
        return value & 0xFFFFFFFF
    tabs = _tables_upto(length.bit_length() - 1)
    while length:               # one step per bit set (a 128 KiB block's length: one)
        low = length & -length
        t0, t1, t2, t3, _ = tabs[low.bit_length() - 1]
        value = t0[value & 0xFF] ^ t1[(value >> 8) & 0xFF] ^ t2[(value >> 16) & 0xFF] ^ t3[value >> 24]
        length ^= low
    return value


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``crc32c(a + b)`` given ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    return crc32c_shift(crc_a, len_b) ^ crc_b


# ---------------------------------------------------------------------------------------------------------

def measure_gibps(fn: Callable | None = None, size: int = 1 << 20, seconds: float = 0.3) -> float:
    """Throughput of ``fn`` (default: the active ``crc32c``) over a random ``size``-byte buffer, in GiB/s."""
    fn = fn or crc32c
    buf = os.urandom(size)
    fn(buf)
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        fn(buf)
        n += 1
        t = time.perf_counter()
        if t >= deadline:
            break
    return n * size / (t - t0) / (1 << 30)


if __name__ == "__main__":  # python -m wire.crc
    why = use_fastest()
    print(f"backend={BACKEND} hardware={HARDWARE}: {why}")
    if hw_crc32c is not None:
        print(f"crc32c: {measure_gibps(hw_crc32c):.2f} GiB/s")
    print(f"crcmod: {measure_gibps(crcmod_crc32c, seconds=0.5):.3f} GiB/s")
