"""TLS and mutual TLS with real clients (issue 11 item 5): a throwaway CA, server and client
certificates made with ``cryptography``; ``httpx`` with ``verify=`` / ``cert=`` and the
``openai`` SDK over an ``httpx`` client talk to the server (the scripted engine of
``tests/fakes.py``). Also: config.json ``httpsEnabled``, the ``--ssl-*`` flags and the
``allowAllZeroIpListening`` guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.fakes import FakeEngine
from tokenserve.cli import build_parser, serve_config
from tokenserve.config.mindie_json import load_mindie_config
from tokenserve.server.app import serve
from tokenserve.transport.listeners import bind_listeners
from tokenserve.transport.planes import Plane, plane_layout
from tokenserve.transport.server import HttpServer
from tokenserve.config.tree import TlsSettings

ROOT = Path(__file__).resolve().parents[2]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False,
           server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem, server.pem/.key (127.0.0.1, localhost), client.pem/.key."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _issue("test CA", ca_key, _name("test CA"), ca_key, ca=True)
    _write(d / "ca", ca, ca_key)
    for who, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(d / who, _issue(who, key, ca.subject, ca_key, server=server), key)
    return d


def client_ctx(pki: Path, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        ctx.load_cert_chain(pki / "client.pem", pki / "client.key")
    return ctx


@contextlib.asynccontextmanager
async def tls_server(pki: Path, management_mtls: bool) -> AsyncIterator[dict[Plane, int]]:
    """Business on TLS; with ``management_mtls`` a separate management listener that
    requires a client certificate."""
    public = TlsSettings(str(pki / "server.pem"), str(pki / "server.key"))
    mutual = TlsSettings(str(pki / "server.pem"), str(pki / "server.key"),
                         ca_files=(str(pki / "ca.pem"),), cert_reqs=2)
    layout = plane_layout("127.0.0.1", 0, management_port=0 if management_mtls else None)
    bound = bind_listeners(layout, {Plane.BUSINESS: public, Plane.MANAGEMENT: mutual,
                                    Plane.METRICS: public})
    loop = asyncio.get_running_loop()
    servers: asyncio.Future[dict[Plane, HttpServer]] = loop.create_future()
    stop = asyncio.Event()
    task = loop.create_task(serve(FakeEngine(), stop=stop, listeners=servers, bound=bound,
                                  shutdown_timeout_s=0.5))
    by_plane = await asyncio.wait_for(servers, 5)
    try:
        yield {p: s.ports[0] for p, s in by_plane.items()}
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_tls_with_httpx_and_the_openai_sdk(pki: Path) -> None:
    import openai

    async with tls_server(pki, management_mtls=False) as ports:
        url = f"https://127.0.0.1:{ports[Plane.BUSINESS]}"
        async with httpx.AsyncClient(verify=client_ctx(pki), timeout=5) as client:
            r = await client.get(f"{url}/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
        async with httpx.AsyncClient(verify=client_ctx(pki), timeout=5) as http:
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", http_client=http,
                                     max_retries=0)
            out = await sdk.completions.create(model="fake-model", prompt="abc", max_tokens=3)
            assert out.choices[0].text and out.choices[0].finish_reason == "length"
        async with httpx.AsyncClient(timeout=5) as untrusting:  # the system CAs only
            with pytest.raises(httpx.ConnectError):
                await untrusting.get(f"{url}/v1/models")


async def test_mutual_tls_on_the_management_plane(pki: Path) -> None:
    async with tls_server(pki, management_mtls=True) as ports:
        mgmt = f"https://127.0.0.1:{ports[Plane.MANAGEMENT]}/health"
        async with httpx.AsyncClient(verify=client_ctx(pki), timeout=5) as no_cert:
            with pytest.raises(httpx.TransportError):  # refused without a certificate
                await no_cert.get(mgmt)
        async with httpx.AsyncClient(verify=client_ctx(pki, cert=True), timeout=5) as c:
            assert (await c.get(mgmt)).status_code == 200
            business = f"https://127.0.0.1:{ports[Plane.BUSINESS]}/health"
            assert (await c.get(business)).status_code == 404  # management routes only there


async def test_plain_http_to_a_tls_port_gets_a_clean_close(pki: Path) -> None:
    async with tls_server(pki, management_mtls=False) as ports:
        port = ports[Plane.BUSINESS]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 3)  # returns: the server closed
        writer.close()
        assert b"HTTP/1.1" not in reply  # no response in clear text, just a close
        async with httpx.AsyncClient(verify=client_ctx(pki), timeout=5) as client:
            assert (await client.get(f"https://127.0.0.1:{port}/v1/models")).status_code == 200


# --------------------------------------------------------------------------- configuration


def _config(tmp_path: Path, pki: Path, **server: object) -> Path:
    doc = json.loads((ROOT / "examples" / "config.json").read_text())
    doc["ServerConfig"].update(server)
    for name in ("server.pem", "server.key", "ca.pem"):
        (tmp_path / name).write_bytes((pki / name).read_bytes())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return path


def test_https_enabled_in_config_json_means_mutual_tls(tmp_path: Path, pki: Path) -> None:
    cfg = load_mindie_config(_config(tmp_path, pki, httpsEnabled=True, tlsCaPath="./",
                                     tlsCaFile=["ca.pem"], tlsCert="server.pem",
                                     tlsPk="server.key"))
    tls = cfg.server.business_tls
    assert tls is not None and tls.mutual and tls.ca_files == (str(tmp_path / "ca.pem"),)
    assert cfg.server.management_tls == tls  # no management keys: the business material
    assert tls.context().verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match="tlsCert"):
        load_mindie_config(_config(tmp_path, pki, httpsEnabled=True, tlsCert="nope.pem",
                                   tlsPk="server.key", tlsCaPath="./"))


def test_max_link_num_and_the_all_zero_guard(tmp_path: Path, pki: Path) -> None:
    cfg = load_mindie_config(_config(tmp_path, pki, maxLinkNum=300))
    assert cfg.server.max_connections == 300
    with pytest.raises(ValueError, match="allowAllZeroIpListening"):
        load_mindie_config(_config(tmp_path, pki, ipAddress="0.0.0.0"))
    cfg = load_mindie_config(_config(tmp_path, pki, ipAddress="0.0.0.0",
                                     allowAllZeroIpListening=True))
    assert cfg.server.host == "0.0.0.0"


def test_all_interfaces_logs_the_exposed_planes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "tokenserve.transport.listeners"):
        bound = bind_listeners(plane_layout("0.0.0.0", 0, "127.0.0.1", 0))
    for b in bound:
        b.sock.close()
    assert "every interface" in caplog.text and "business" in caplog.text
    assert "management" not in caplog.text  # that plane stays on 127.0.0.1


def test_ssl_flags(pki: Path) -> None:
    cert, key, ca = str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem")
    args = build_parser().parse_args(["serve", "--ssl-certfile", cert, "--ssl-keyfile", key,
                                      "--ssl-ca-certs", ca])
    srv = serve_config(args).server
    assert srv.business_tls is not None and srv.business_tls.cert_reqs == 0
    assert srv.management_tls is not None and srv.management_tls.mutual
    with pytest.raises(ValueError, match="--ssl-certfile"):
        serve_config(build_parser().parse_args(["serve", "--ssl-ca-certs", ca]))
    with pytest.raises(ValueError, match="CA file"):
        TlsSettings(cert, key, cert_reqs=2)
