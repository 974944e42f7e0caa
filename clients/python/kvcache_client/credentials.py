"""How a client proves who it is to kvcached: TLS (optionally mutual) and a bearer token.

kvcached's flags and their client-side counterparts (docs/DEPLOY.md, "TLS and tenants"):

==========================  =======================================================
kvcached                    client
==========================  =======================================================
``--tls_cert_file/_key``    ``TlsConfig(ca_file=...)``: the CA that signed it
``--tls_client_ca_file``    ``TlsConfig(cert_file=..., key_file=...)``: a client
                            certificate that CA signed (required by the daemon then)
``--auth_tokens_file``      ``token=`` or ``token_file=``: sent on every call as
                            ``authorization: Bearer <token>``; names the tenant
==========================  =======================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import grpc

__all__ = ["TlsConfig"]


@dataclass(frozen=True)
class TlsConfig:
    """TLS to kvcached. Files are PEM.

    ``ca_file``: the roots the daemon's certificate must chain to (None: the system's).
    ``cert_file`` and ``key_file``: this client's certificate and key, for a daemon run
    with ``--tls_client_ca_file`` (both or neither).
    ``server_name``: the name the daemon's certificate must carry when it is not the
    address's host (e.g. connecting by IP to a certificate issued for a DNS name).
    """

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name: Optional[str] = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TlsConfig: give cert_file and key_file together, or neither")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "ca_file"),
            private_key=_read(self.key_file, "key_file"),
            certificate_chain=_read(self.cert_file, "cert_file"))

    def channel_options(self) -> List[Tuple[str, Any]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def read_token_file(path: str) -> str:
    """The token a file holds: its content with surrounding whitespace stripped (a
    Kubernetes Secret mounted as a file usually ends in a newline). Raises ValueError for
    an empty file or one holding whitespace inside the token."""
    token = _read(path, "token_file").decode("utf-8").strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"token_file {path!r}: expected one token (no spaces), "
                         f"got {'nothing' if not token else 'several words'}")
    return token


def make_channel(address: str, *, tls: Optional[TlsConfig], token: Optional[str],
                 options: Sequence[Tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``address`` with TLS when ``tls`` is given and the token on every call.

    The token travels through a client interceptor rather than gRPC's call credentials so
    that it also works over a plaintext unix socket or loopback (gRPC refuses call
    credentials on insecure channels): a worker on the daemon's node may authenticate
    without TLS. Across the network, use TLS, or the token is readable on the wire."""
    options = list(options)
    if tls is not None:
        channel = grpc.secure_channel(address, tls.channel_credentials(),
                                      options=options + tls.channel_options())
    else:
        channel = grpc.insecure_channel(address, options=options)
    if token is None:
        return channel
    if not token or any(c.isspace() for c in token):
        raise ValueError("token must be one non-empty word")
    return grpc.intercept_channel(channel, _BearerToken(token))


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if path is None:
        return None
    try:
        with open(os.fspath(path), "rb") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"{what} {path!r}: {error.strerror}") from None


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: List[Tuple[str, str]]):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call's metadata."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != "authorization"]
        return _CallDetails(details, metadata + [self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)
