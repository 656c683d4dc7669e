"""Fixtures shared by the test files: a test PKI, a real Alertmanager, a channel to a module's collector and an
in-memory Ingest server, each on loopback. Plain helper functions live in helpers.py."""
from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpuwatch.collector import client
from gpuwatch.simulator.collector_sink import IngestSink
from helpers import start_alertmanager



# ------------------------------------------------------------------------------------------- PKI
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer=None, *, ca=False, san=()):
    """(key, cert) signed by ``issuer`` = (key, cert), or self-signed when None."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    signer_key, signer_name = (issuer[0], issuer[1].subject) if issuer else (key, _name(subject))
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(signer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(san)), critical=False)
    return key, builder.sign(signer_key, hashes.SHA256())


def _write(tmp: Path, name: str, key, cert) -> tuple[str, str]:
    cert_path, key_path = tmp / f"{name}.crt", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM paths: ca, rogue_ca, server(_key) for 127.0.0.1/localhost, client(_key) and rogue_client(_key)
    (signed by the rogue CA)."""
    tmp = tmp_path_factory.mktemp("pki")
    ca = _issue("gpuwatch test CA", ca=True)
    rogue_ca = _issue("rogue CA", ca=True)
    server = _issue("collector", ca, san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _issue("agent-node-1", ca)
    rogue_client = _issue("intruder", rogue_ca)
    paths = {"ca": _write(tmp, "ca", *ca)[0], "rogue_ca": _write(tmp, "rogue_ca", *rogue_ca)[0]}
    for name, pair in (("server", server), ("client", client), ("rogue_client", rogue_client)):
        paths[name], paths[name + "_key"] = _write(tmp, name, *pair)
    return paths


# ---------------------------------------------------------------------------------- Alertmanager
@pytest.fixture
def alertmanager(tmp_path):
    """The base URL of a real Alertmanager on a free loopback port (skipped where it is not installed)."""
    proc, url = start_alertmanager(tmp_path)
    yield url
    proc.terminate()
    proc.wait(10)


# ------------------------------------------------------------------------------------- collector
@pytest.fixture
def channel(collector):
    """A gRPC channel to the test module's ``collector`` fixture (helpers.serving)."""
    ch = client.channel(collector.address)
    yield ch
    ch.close()


# ------------------------------------------------------------------------------------------ sink
@pytest.fixture
def sink():
    """(server, "127.0.0.1:PORT"): an in-memory Ingest server (gpuwatch.simulator.collector_sink) on a free
    loopback port."""
    s = IngestSink()
    port = s.start()
    yield s, f"127.0.0.1:{port}"
    s.stop()
