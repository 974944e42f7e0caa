"""The Python client against a kvcached that requires TLS, client certificates and bearer
tokens: certificates made by `openssl` for each session, real daemons on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from daemon import Daemon, flag_missing_reason
from kvcache_client import KvCacheClient, KvCacheError, TlsConfig


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _new_key_and_request(name: str, subject: str, cwd: Path) -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
             cwd=cwd)


def _new_ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=cwd)


def _sign(name: str, ca: str, extensions: str, cwd: Path) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
             "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca (signs the daemon and the client), other-ca (signs a client the daemon must
    refuse); server.pem for 127.0.0.1 and localhost; client.pem; stranger.pem."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command (scripts/install-deps.sh installs it)")
    reason = flag_missing_reason("tls_cert_file")
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("pki")
    _new_ca("ca", d)
    _new_ca("other-ca", d)
    _new_key_and_request("server", "/CN=kvcached", d)
    _sign("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n", d)
    for name, ca in (("client", "ca"), ("stranger", "other-ca")):
        _new_key_and_request(name, f"/CN={name}", d)
        _sign(name, ca, "extendedKeyUsage=clientAuth\n", d)
    (d / "tokens").write_text("# token tenant\ntoken-a team-a\n\ntoken-b team-b\n")
    return d


def _start(tmp_path: Path, pki: Path, *flags: str) -> Daemon:
    return Daemon(tmp_path, f"--tls_cert_file={pki / 'server.pem'}",
                  f"--tls_key_file={pki / 'server.key'}", *flags).start()


@pytest.fixture
def mtls_daemon(tmp_path, pki):
    daemon = _start(tmp_path, pki, f"--tls_client_ca_file={pki / 'ca.pem'}",
                    f"--auth_tokens_file={pki / 'tokens'}")
    yield daemon
    assert daemon.terminate() == 0, daemon.log()


def _client(daemon: Daemon, pki: Path, cert: str = "client", **kwargs) -> KvCacheClient:
    tls = TlsConfig(ca_file=str(pki / "ca.pem"), cert_file=str(pki / f"{cert}.pem"),
                    key_file=str(pki / f"{cert}.key"))
    return KvCacheClient(daemon.address, timeout=10, tls=tls, **kwargs)


def test_a_tenant_steps_over_mutual_tls_with_its_token(mtls_daemon, pki):
    with _client(mtls_daemon, pki, token="token-a") as client:
        client.open_sequence("s", 16, budget_tokens=8)
        with client.batch() as batch:
            batch.add("s")
            decision = batch.step({"s": [[float(i) for i in range(17)]]})["s"]
            assert len(decision.raise_for_status().evicted) == 17 - 8
        assert client.inspect("s").last_step == 1
        assert [s.sequence_id for s in client.list_sequences()] == ["s"]


def test_tenants_see_only_their_own_sequences(mtls_daemon, pki, tmp_path):
    token_file = tmp_path / "token-b"
    token_file.write_text("token-b\n")  # a mounted Secret ends in a newline
    with _client(mtls_daemon, pki, token="token-a") as a, \
            _client(mtls_daemon, pki, token_file=str(token_file)) as b:
        a.open_sequence("shared-name", 16, budget_tokens=8)
        a.open_sequence("only-a", 16, budget_tokens=8)
        for call in (lambda: b.inspect("only-a"), lambda: b.close_sequence("only-a")):
            with pytest.raises(KvCacheError) as error:
                call()
            assert error.value.code == grpc.StatusCode.NOT_FOUND
        # The same id is another sequence in another tenant.
        b.open_sequence("shared-name", 32, budget_tokens=4)
        assert b.inspect("shared-name").prefill_len == 32
        assert a.inspect("shared-name").prefill_len == 16
        assert sorted(s.sequence_id for s in a.list_sequences()) == ["only-a", "shared-name"]
        assert [s.sequence_id for s in b.list_sequences()] == ["shared-name"]
        assert a.inspect("only-a").last_step == 0  # b's attempts changed nothing


@pytest.mark.parametrize("token", [None, "token-c"])
def test_a_call_without_a_known_token_is_unauthenticated(mtls_daemon, pki, token):
    with _client(mtls_daemon, pki, token=token) as client:
        with pytest.raises(KvCacheError) as error:
            client.list_sequences()
        assert error.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("cert", [None, "stranger"])
def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(mtls_daemon, pki, cert):
    tls = TlsConfig(ca_file=str(pki / "ca.pem")) if cert is None else TlsConfig(
        ca_file=str(pki / "ca.pem"), cert_file=str(pki / f"{cert}.pem"),
        key_file=str(pki / f"{cert}.key"))
    with KvCacheClient(mtls_daemon.address, timeout=10, tls=tls, token="token-a") as client:
        with pytest.raises(KvCacheError) as error:
            client.list_sequences()
        assert error.value.code == grpc.StatusCode.UNAVAILABLE


def _health_check(address: str, service: str) -> bytes:
    """grpc.health.v1.Health/Check over plaintext, encoded by hand (HealthCheckRequest is
    field 1, the service name; the reply's field 1 is the status, 1 for SERVING)."""
    request = (b"\x0a" + bytes([len(service)]) + service.encode()) if service else b""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        return check(request, timeout=10)


def test_a_plaintext_client_cannot_talk_to_a_tls_daemon(tmp_path, pki):
    daemon = _start(tmp_path, pki, "--health_listen=127.0.0.1:0")
    try:
        # The kubelet's probes: plaintext health on its own port, SERVING.
        health = json.loads(daemon.port_file.read_text())["health"]
        for service in ("", "kvcache.v1.KvCache"):
            assert _health_check(health, service) == b"\x08\x01"
        with pytest.raises(grpc.RpcError) as error:
            grpc.insecure_channel(health).unary_unary("/kvcache.v1.KvCache/ListSequences")(
                b"", timeout=10)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED  # nothing but health
        with KvCacheClient(daemon.address, timeout=10) as plain:
            with pytest.raises(KvCacheError) as error:
                plain.list_sequences()
            assert error.value.code == grpc.StatusCode.UNAVAILABLE
        # Server-only TLS: the CA is all a client needs; a name override reaches it by a
        # name its certificate carries.
        tls = TlsConfig(ca_file=str(pki / "ca.pem"), server_name="localhost")
        with KvCacheClient(daemon.address, timeout=10, tls=tls) as client:
            assert client.list_sequences() == []
    finally:
        assert daemon.terminate() == 0, daemon.log()


def test_bad_credentials_are_refused_before_any_call(pki, tmp_path):
    with pytest.raises(ValueError, match="cert_file and key_file"):
        TlsConfig(cert_file=str(pki / "client.pem"))
    with pytest.raises(ValueError, match="ca_file"):
        KvCacheClient("127.0.0.1:1", tls=TlsConfig(ca_file=str(tmp_path / "absent.pem")))
    with pytest.raises(ValueError, match="one of token and token_file"):
        KvCacheClient("127.0.0.1:1", token="a", token_file=str(pki / "tokens"))
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(ValueError, match="several words"):
        KvCacheClient("127.0.0.1:1", token_file=str(tmp_path / "two"))
