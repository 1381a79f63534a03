"""TLS and mutual TLS for a listener, with the standard library's :mod:`ssl`
(spec/interfaces.md §0.2: HTTPS when ``httpsEnabled``, mutual TLS with the configured
CA; config.md §1 ``tlsCert`` / ``tlsPk`` / ``tlsCaFile`` / ``tlsCrlFiles`` per plane).

The h11 server is unchanged: ``loop.create_server(ssl=context)`` wraps each connection, so
:class:`tokenserve.transport.server.HttpProtocol` sees plain bytes. A client that speaks plain
HTTP to a TLS port fails the handshake and its connection is closed; a client without a
certificate is refused by a listener that requires one (``CERT_REQUIRED``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

#: uvicorn's ``--ssl-cert-reqs`` values (``ssl.VerifyMode``): 0 none, 1 optional, 2 required.
CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class TlsSettings:
    """One listener's TLS material.

    Attributes:
        certfile: server certificate chain, PEM.
        keyfile: its private key, PEM.
        password_file: a file holding the key's passphrase in plain text, or None
            ([I] MindIE's ``tlsPkPwd`` is KMC-encrypted; we read it as plain text).
        ca_files: CA certificates that client certificates are verified against, PEM.
        crl_files: certificate revocation lists, PEM (checked for the client's cert).
        cert_reqs: 0 no client certificate asked, 1 optional, 2 required (mutual TLS).
    """

    certfile: str
    keyfile: str
    password_file: str | None = None
    ca_files: tuple[str, ...] = ()
    crl_files: tuple[str, ...] = ()
    cert_reqs: int = 0

    def __post_init__(self) -> None:
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"ssl cert_reqs must be 0, 1 or 2, got {self.cert_reqs}")
        if self.cert_reqs and not self.ca_files:
            raise ValueError("asking for client certificates (ssl cert_reqs 1 or 2) needs "
                             "a CA file to verify them (--ssl-ca-certs / tlsCaFile)")

    @property
    def mutual(self) -> bool:
        """Client certificates are required."""
        return self.cert_reqs == 2

    def context(self) -> ssl.SSLContext:
        """A server context (TLS 1.2 or newer, ALPN ``http/1.1``).

        Raises:
            ValueError: a file is missing or unreadable, or the key does not match the
                certificate (the message names the file).
        """
        for f in (self.certfile, self.keyfile, *self.ca_files, *self.crl_files):
            if not Path(f).is_file():
                raise ValueError(f"TLS file {f} does not exist")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        password = None
        if self.password_file is not None:
            password = Path(self.password_file).read_text(encoding="utf-8").strip()
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile, password)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"TLS certificate {self.certfile} / key {self.keyfile}: "
                             f"{exc}") from None
        for f in (*self.ca_files, *self.crl_files):
            try:
                ctx.load_verify_locations(cafile=f)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"TLS file {f}: {exc}") from None
        if self.crl_files:
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        ctx.verify_mode = CERT_REQS[self.cert_reqs]
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx
