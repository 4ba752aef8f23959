"""The webhook's TLS certificate: a small CA and a serving certificate, made with ``cryptography``.

kopf's own self-signed certificates need certbuilder/oscrypto, which fail to load with OpenSSL
3.0.10 and later, so the controller makes its own. The API server trusts the CA
through the webhook configuration's caBundle.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 3650


@dataclass(frozen=True)
class CertBundle:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_certificate(hosts: list[str], days: int = VALID_DAYS) -> CertBundle:
    """A CA and a serving certificate for ``hosts`` (IP addresses become IP SANs, names DNS SANs)."""
    if not hosts:
        raise ValueError("a webhook certificate needs at least one host, e.g. 127.0.0.1")
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(_name("mig-operator webhook CA")).issuer_name(
            _name("mig-operator webhook CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return CertBundle(
        ca_pem=ca.public_bytes(serialization.Encoding.PEM),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
    )


class CertificateFileError(ValueError):
    """A given certificate or key file that cannot serve: missing, unreadable, not PEM, or not a pair."""


def _read_pem(path: str, what: str, flag: str, example: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(1 << 20)  # a certificate chain is a few KiB; no need to read a device to its end
    except OSError as exc:
        raise CertificateFileError(f"{flag} {path!r}: cannot read the {what}: {exc.strerror or exc}; "
                                   f"give a PEM file, e.g. {flag} {example}") from None
    except ValueError as exc:  # a path holding a NUL byte
        raise CertificateFileError(f"{flag} {path!r}: {exc}; e.g. {flag} {example}") from None


def check_pem_pair(cert_file: str, key_file: str) -> None:
    """Refuse, before anything starts, a serving certificate and key that the TLS server could not load:
    each must be readable PEM (an unencrypted key), and the key must be the certificate's."""
    import ssl

    cert_pem = _read_pem(cert_file, "certificate", "--webhook-cert", "tls.crt")
    key_pem = _read_pem(key_file, "private key", "--webhook-key", "tls.key")
    try:
        if not x509.load_pem_x509_certificates(cert_pem):
            raise ValueError("no certificate")
    except ValueError:
        raise CertificateFileError(f"--webhook-cert {cert_file!r} holds no PEM certificate (-----BEGIN CERTIFICATE-----"
                                   "); e.g. --webhook-cert tls.crt") from None
    try:
        serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:  # cryptography's word for "encrypted, and no password given"
        raise CertificateFileError(f"--webhook-key {key_file!r} is encrypted; give an unencrypted PEM key, "
                                   "e.g. --webhook-key tls.key") from None
    except (ValueError, UnsupportedAlgorithm):
        raise CertificateFileError(f"--webhook-key {key_file!r} holds no PEM private key (-----BEGIN PRIVATE KEY-----"
                                   "); e.g. --webhook-key tls.key") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
    except ssl.SSLError:
        raise CertificateFileError(f"--webhook-key {key_file!r} is not the key of --webhook-cert {cert_file!r}; "
                                   "give the pair, e.g. --webhook-cert tls.crt --webhook-key tls.key") from None
