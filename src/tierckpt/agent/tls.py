"""TLS 1.3 for the peer stream, its server certificate bound to the job secret.

Python 3.11's ``ssl`` has no external pre-shared keys (``set_psk_*_callback`` arrived in 3.13),
so each agent makes an ephemeral ECDSA P-256 key and a self-signed certificate when it starts
(``openssl req``, the key never leaves a private temporary directory and is deleted once
loaded) and the client accepts any certificate in the TLS handshake. What authenticates the
server is the application handshake inside the tunnel: both MACs (keyed by the job secret)
cover the SHA-256 of the certificate the client saw (RFC 5929 ``tls-server-end-point``, the
channel binding of SCRAM-SHA-256-PLUS). A relay that terminates TLS must show the client a
certificate of its own, so the MACs the two ends compute differ and neither proof is
accepted; TLS then provides the record framing, encryption, integrity, replay and reordering
protection (AES-GCM, sequence-numbered records), not our code.

Call order: ``ServerTLS.create()`` once per agent → ``server.wrap(sock)`` per accepted
connection (after the plaintext hello) → ``server.end_point`` in the MACs; a client calls
``client_wrap(sock)`` after reading the hello, then ``peer_end_point(tls_sock)``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
from dataclasses import dataclass

from tierckpt.errors import ConfigError

__all__ = ["ServerTLS", "client_wrap", "peer_end_point"]


@dataclass(frozen=True)
class ServerTLS:
    """One agent's TLS server side: a context holding its ephemeral key, and the certificate's hash."""

    context: ssl.SSLContext
    end_point: bytes  # SHA-256 of the DER certificate (tls-server-end-point)

    @classmethod
    def create(cls) -> ServerTLS:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise ConfigError("the agent's TLS needs the `openssl` command (apt-get install openssl) to make its "
                              "ephemeral certificate; on a fabric you trust, --insecure-wire runs without TLS")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.num_tickets = 0  # no resumption: and a ticket the client never reads turns its close into a reset
        private = tempfile.mkdtemp(prefix="tierckpt-agent-tls-")  # 0700: only this user reads the key
        try:
            key, cert = os.path.join(private, "key.pem"), os.path.join(private, "cert.pem")
            done = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                                   "-nodes", "-keyout", key, "-out", cert, "-days", "3650", "-subj", "/CN=tierckpt-agent",
                                   "-sha256"], capture_output=True, text=True, timeout=60, check=False)
            if done.returncode != 0:
                raise ConfigError(f"making the agent's TLS certificate failed: {done.stderr.strip()[-300:]}")
            ctx.load_cert_chain(cert, key)
            with open(cert) as f:
                der = ssl.PEM_cert_to_DER_cert(f.read())
        finally:
            shutil.rmtree(private, ignore_errors=True)
        return cls(ctx, hashlib.sha256(der).digest())

    def wrap(self, sock: socket.socket) -> ssl.SSLSocket:
        """The server side of the TLS handshake on ``sock`` (its timeout applies)."""
        return self.context.wrap_socket(sock, server_side=True)


def _client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the certificate is pinned by the MACs instead (module docstring)
    return ctx


_CLIENT = _client_context()  # immutable once made; wrap_socket does not change it


def client_wrap(sock: socket.socket) -> ssl.SSLSocket:
    """The client side of the TLS handshake on ``sock`` (its timeout applies)."""
    return _CLIENT.wrap_socket(sock, server_side=False)


def peer_end_point(sock: ssl.SSLSocket) -> bytes:
    """SHA-256 of the certificate the server showed on ``sock``."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError("the peer showed no certificate")
    return hashlib.sha256(der).digest()
