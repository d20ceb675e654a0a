"""Test certificates: self-signed ones for the cache's TLS tests, and a CA-signed set as
cert-manager's CA issuer makes a `kubernetes.io/tls` Secret, shared by the cache's TLS tests (as a
mounted folder) and the kind suite (as the Secret itself)."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: x509.Name,
    issuer: x509.Name,
    public_key,
    signing_key,
    ca: bool,
    sans: list[x509.GeneralName],
    expired: bool = False,
) -> x509.Certificate:
    """Valid from 5 minutes ago for a day (``expired``: from two days ago until yesterday);
    ``sans`` (may be empty) as its subject alternative names."""
    now = datetime.datetime.now(datetime.UTC)
    since, until = (
        (now - datetime.timedelta(days=2), now - datetime.timedelta(days=1))
        if expired
        else (
            now - datetime.timedelta(minutes=5),
            now + datetime.timedelta(days=1),
        )
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(since)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def self_signed_pems(ip: str, dns: str) -> tuple[bytes, bytes]:
    """A self-signed certificate for ``ip`` and ``dns`` (server certificate and root of trust in
    one), and its key; PEM each."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("data-cache-test")
    sans = [x509.IPAddress(ipaddress.ip_address(ip)), x509.DNSName(dns)]
    return _pem(_certificate(name, name, key.public_key(), key, True, sans)), _key_pem(key)


def tls_secret_pems(dns: str, expired: bool = False) -> dict[str, bytes]:
    """``tls.crt`` (a leaf naming only ``dns``: no address, as for pods whose IPs are not known in
    advance), ``tls.key``, and ``ca.crt``, the CA that signed it (which is not the leaf, so
    trusting the leaf will not do); PEM each."""
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("data-cache-test-ca")
    ca = _certificate(ca_name, ca_name, ca_key.public_key(), ca_key, True, [])
    leaf = _certificate(_name(dns), ca_name, leaf_key.public_key(), ca_key, False, [x509.DNSName(dns)], expired)
    return {"ca.crt": _pem(ca), "tls.crt": _pem(leaf), "tls.key": _key_pem(leaf_key)}
