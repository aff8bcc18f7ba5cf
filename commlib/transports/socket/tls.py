"""TLS for the socket transport's links (``COMMLIB_SOCKET_TLS=1``), for networks nobody trusts.

Mutual TLS (1.2 or later): each end presents its certificate and checks the other's against the
CA file (default: its own certificate, so a single self-signed pair copied to every rank works);
host names are not checked (ranks connect to addresses). The job-secret handshake then runs
inside TLS, *bound* to both certificates' fingerprints: a man in the middle with a certificate
of its own the CA signed still cannot complete it, and a job whose secret leaked still gets
encryption. Costs: a TLS handshake per connection, and every byte encrypted and copied once more
(measured by ``python -m commlib.transports.socket.bench``).
"""

from __future__ import annotations

import hashlib
import ssl
from typing import Optional

from commlib.errors import InvalidUsageError
from commlib.transports.socket.options import TLSFiles

__all__ = ["TLSContexts", "channel_binding"]


class TLSContexts:
    """The client and server contexts of one rank, and its certificate's fingerprint."""

    def __init__(self, files: TLSFiles):
        try:
            with open(files.cert) as handle:
                self.fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(handle.read())).digest()
            self.client = self._context(ssl.PROTOCOL_TLS_CLIENT, files)
            self.server = self._context(ssl.PROTOCOL_TLS_SERVER, files)
        except (OSError, ssl.SSLError, ValueError) as error:
            raise InvalidUsageError(f"socket transport TLS: cannot use certificate {files.cert!r}, key "
                                    f"{files.key!r}, CA {files.ca or files.cert!r}: {error}") from None

    @staticmethod
    def _context(protocol: int, files: TLSFiles) -> ssl.SSLContext:
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(files.cert, files.key)
        context.load_verify_locations(files.ca or files.cert)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        return context


def channel_binding(server_fingerprint: bytes, client_fingerprint: Optional[bytes]) -> bytes:
    """What both ends mix into the handshake's MACs: the two certificates they saw."""
    return b"tls " + server_fingerprint + (client_fingerprint or b"")


def peer_fingerprint(sock: ssl.SSLSocket) -> bytes:
    der = sock.getpeercert(binary_form=True)
    return hashlib.sha256(der).digest() if der else b""
