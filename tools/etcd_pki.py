"""A small certificate authority for a cluster's etcd: the members' server certificate and one client
certificate per component and per datanode, so that etcd takes no connection from anyone without one.

Made with ``cryptography`` (no openssl at run time).  Layout of the directory (0700; keys 0600):

* ``ca.pem`` / ``ca.key``   -- the CA.  Its key signs new certificates only: keep it off the cluster's hosts
  once every certificate is issued (``dnctl etcd issue`` needs it again for a new node).
* ``server.pem`` / ``.key`` -- the members' certificate: client and peer URLs, both usages (etcd's JSON
  gateway dials its own gRPC server with it, as a client).
* ``NAME.pem`` / ``NAME.key`` -- a client certificate per component (``manager``, ``admin``, ``mount``,
  ``root``) and per datanode (``node-HOST-PORT``).

Client certificates carry **no Common Name**: with client certificates required and its users on, etcd 3.4's
gateway refuses any request whose certificate has one (it would name an etcd user the gateway cannot pass
on).  Who the client is comes from its etcd user; the certificate says only "issued by this cluster's CA"
(its Organizational Unit names what it was issued for, for an operator reading it).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib

CA_DAYS = 3650             # the CA outlives every certificate it signs; rotated by hand (docs/operations.md)
CERT_DAYS = 825            # a leaf certificate: re-issued by `dnctl etcd issue` before then
ORG = "datanode cluster etcd"


def _write(path: pathlib.Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())    # P-256: small, fast, taken by Go's TLS (etcd)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load(d: pathlib.Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    try:
        cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    except FileNotFoundError as e:
        raise ValueError(f"{e.filename}: no such file (the etcd CA: made by `dnctl cluster up`, "
                         f"or `dnctl etcd issue --new-ca`)") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"the etcd CA in {d} is unreadable: {e}") from None
    return cert, key


def make_ca(d: pathlib.Path, name: str = "cluster") -> str:
    """A new CA in ``d`` (which is made 0700); returns the path of ``ca.pem``.  An existing one is kept."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    if (d / "ca.pem").exists():
        _load(d)
        return str((d / "ca.pem").resolve())
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"etcd CA of {name}"[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(d / "ca.key", _key_pem(key), 0o600)
    _write(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return str((d / "ca.pem").resolve())


def issue(d: pathlib.Path, name: str, *, hosts: tuple[str, ...] = ()) -> tuple[str, str]:
    """A certificate ``d/NAME.pem`` and its key ``d/NAME.key`` signed by the CA in ``d``; returns their
    paths.  ``hosts`` (IP addresses or DNS names): a server certificate for them (the etcd members), usable
    as a client too; none: a client certificate, with no Common Name (see above)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad certificate name {name!r}")
    ca_cert, ca_key = _load(d)
    key = _key()
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
               x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, name[:64])]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    sans: list = []
    if hosts:
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64]))
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name(subject)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(min(now + datetime.timedelta(days=CERT_DAYS), ca_cert.not_valid_after_utc))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    _write(d / f"{name}.key", _key_pem(key), 0o600)
    _write(d / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return str((d / f"{name}.pem").resolve()), str((d / f"{name}.key").resolve())


def paths(d: pathlib.Path | str, name: str) -> dict[str, str]:
    """``EtcdAccess.load``'s ``ca``, ``cert``, ``key`` for the client certificate ``name`` in ``d``."""
    d = pathlib.Path(d)
    return {"ca": str(d / "ca.pem"), "cert": str(d / f"{name}.pem"), "key": str(d / f"{name}.key")}
