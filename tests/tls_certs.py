"""Test certificates as cert-manager's CA issuer makes a `kubernetes.io/tls` Secret: shared by the
cache's TLS tests (as a mounted folder) and the kind suite (as the Secret itself)."""

from __future__ import annotations

import datetime


def tls_secret_pems(dns: str) -> dict[str, bytes]:
    """``tls.crt`` (a leaf naming only ``dns``: no address, as for pods whose IPs are not known in
    advance), ``tls.key``, and ``ca.crt``, the CA that signed it (which is not the leaf, so
    trusting the leaf will not do); PEM each."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: x509.Name, public_key, signing_key, ca: bool, san: str | None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "data-cache-test-ca")])
    ca = build("data-cache-test-ca", ca_name, ca_key.public_key(), ca_key, True, None)
    leaf = build(dns, ca_name, leaf_key.public_key(), ca_key, False, dns)
    key = leaf_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return {
        "ca.crt": ca.public_bytes(serialization.Encoding.PEM),
        "tls.crt": leaf.public_bytes(serialization.Encoding.PEM),
        "tls.key": key,
    }
