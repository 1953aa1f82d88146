"""POSIX ACLs as the kernel hands them to a FUSE filesystem: the ``system.posix_acl_access`` /
``system.posix_acl_default`` xattr codec and the rules that tie an ACL to the file mode (pure: no I/O).

The mount asks the kernel for FUSE_POSIX_ACL: the kernel then caches the ACLs and enforces them itself
(default_permissions), and leaves to the filesystem what POSIX.1e says happens to the stored ACL and mode --
the mode's permission bits follow an access ACL that is set (:func:`mode_bits`), a chmod rewrites the ACL's
owner, mask (or group) and other entries (:func:`chmod`), a new inode in a directory with a default ACL
inherits it (:func:`inherit`), and an ACL the mode already says exactly is not stored (:func:`equivalent`).

Wire format (linux/posix_acl_xattr.h): a little-endian u32 version (2), then per entry u16 tag, u16 perm,
u32 id (``UNDEFINED_ID`` for the entries that name no user or group).
"""
from __future__ import annotations

import stat
import struct

ACCESS = b"system.posix_acl_access"
DEFAULT = b"system.posix_acl_default"
NAMES = (ACCESS, DEFAULT)

VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
_HEAD = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
_ORDER = {USER_OBJ: 0, USER: 1, GROUP_OBJ: 2, GROUP: 3, MASK: 4, OTHER: 5}

Entry = tuple[int, int, int]      # (tag, perm, id)


class AclError(ValueError):
    """Not a valid POSIX ACL (the kernel's answer is EINVAL)."""


def parse(value: bytes) -> list[Entry]:
    """The entries of an ACL xattr, checked as the kernel checks them (``posix_acl_valid``)."""
    if len(value) < _HEAD.size or (len(value) - _HEAD.size) % _ENTRY.size:
        raise AclError("ACL of a wrong length")
    if _HEAD.unpack_from(value)[0] != VERSION:
        raise AclError("unknown ACL version")
    entries = [_ENTRY.unpack_from(value, off) for off in range(_HEAD.size, len(value), _ENTRY.size)]
    seen = {t: 0 for t in _ORDER}
    named: set[tuple[int, int]] = set()
    last = -1
    for tag, perm, id_ in entries:
        if tag not in _ORDER:
            raise AclError(f"unknown ACL entry tag {tag:#x}")
        if perm & ~7:
            raise AclError("ACL permission beyond rwx")
        if _ORDER[tag] < last:
            raise AclError("ACL entries out of order")
        last = _ORDER[tag]
        seen[tag] += 1
        if tag in (USER, GROUP):
            if (tag, id_) in named:
                raise AclError("ACL names a user or group twice")
            named.add((tag, id_))
    if seen[USER_OBJ] != 1 or seen[GROUP_OBJ] != 1 or seen[OTHER] != 1 or seen[MASK] > 1:
        raise AclError("an ACL needs one owner, one owning-group and one other entry")
    if named and not seen[MASK]:
        raise AclError("an ACL with named users or groups needs a mask entry")
    return entries


def encode(entries: list[Entry]) -> bytes:
    return _HEAD.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)


def _perm(entries: list[Entry], tag: int) -> int | None:
    return next((p for t, p, _ in entries if t == tag), None)


def mode_bits(entries: list[Entry]) -> int:
    """The rwxrwxrwx bits that say the same: owner, mask (owning group without one), other."""
    group = _perm(entries, MASK)
    if group is None:
        group = _perm(entries, GROUP_OBJ)
    return (_perm(entries, USER_OBJ) << 6) | (group << 3) | _perm(entries, OTHER)


def equivalent(entries: list[Entry]) -> bool:
    """Does the mode alone say all of it (no named entry, no mask)?  Such an ACL is not stored."""
    return all(t in (USER_OBJ, GROUP_OBJ, OTHER) for t, _, _ in entries)


def chmod(entries: list[Entry], mode: int) -> list[Entry]:
    """The access ACL after a chmod to ``mode``: owner, mask (or owning group) and other take its bits."""
    has_mask = _perm(entries, MASK) is not None
    out = []
    for tag, perm, id_ in entries:
        if tag == USER_OBJ:
            perm = (mode >> 6) & 7
        elif tag == MASK or (tag == GROUP_OBJ and not has_mask):
            perm = (mode >> 3) & 7
        elif tag == OTHER:
            perm = mode & 7
        out.append((tag, perm, id_))
    return out


def inherit(default: bytes, mode: int) -> tuple[int, bytes | None, bytes | None]:
    """A new inode of ``mode`` (type and requested permission bits) in a directory whose default ACL is
    ``default``: returns (its mode, its access ACL or None, its default ACL or None).  The default ACL is
    laid over the requested bits (``posix_acl_create_masq``): owner, mask (or owning group) and other keep
    only what both allow; a directory also inherits the default ACL itself.  Symlinks take none."""
    if stat.S_ISLNK(mode):
        return mode, None, None
    entries = parse(default)
    has_mask = _perm(entries, MASK) is not None
    out = []
    for tag, perm, id_ in entries:
        if tag == USER_OBJ:
            perm &= (mode >> 6) & 7
            mode &= (perm << 6) | ~0o700
        elif tag == MASK or (tag == GROUP_OBJ and not has_mask):
            perm &= (mode >> 3) & 7
            mode &= (perm << 3) | ~0o070
        elif tag == OTHER:
            perm &= mode & 7
            mode &= perm | ~0o007
        out.append((tag, perm, id_))
    access = None if equivalent(out) else encode(out)
    return mode, access, default if stat.S_ISDIR(mode) else None


def kernel_enforces(release: str) -> bool:
    """Does a kernel of this release (``uname -r``) offer FUSE_POSIX_ACL (Linux 4.9 and later)?  Without it
    the mount refuses ACLs rather than store rules nobody applies."""
    try:
        major, minor = (int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (4, 9)


def in_group_or_capable(proc_status: str, gid: int) -> bool:
    """From a caller's /proc/PID/status: may it keep a file's set-group-ID bit -- a member of the file's
    group ``gid`` (fs, effective or supplementary), or holding CAP_FSETID?  (Setting an access ACL clears
    the bit otherwise, as chmod does; the kernel leaves that to the filesystem here.)"""
    fields = dict(line.split(":", 1) for line in proc_status.splitlines() if ":" in line)
    try:
        if int(fields.get("CapEff", "0").strip(), 16) & (1 << 4):        # CAP_FSETID
            return True
        gids = {int(g) for g in fields.get("Gid", "").split()}
        gids |= {int(g) for g in fields.get("Groups", "").split()}
    except ValueError:
        return False
    return gid in gids
