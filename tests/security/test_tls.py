"""TLS on every gRPC connection (dataservice.tls): data flows with TLS (OFF and
DYNAMIC over gRPC, shared memory still used on one host), mismatches fail at
first contact with an error naming TLS, mutual TLS refuses a client without a
certificate, and bad files are named at start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

import dataservice as ds
from dataservice import auth, errors, tls
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.timeout(120)

TOKEN = "tls-test-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("tls-other")), ca_name="another CA")


@pytest.fixture
def env(monkeypatch):
    """A clean TLS/auth environment for the trainer side of each test."""
    for var in (tls.TLS_CA_ENV, tls.TLS_CERT_ENV, tls.TLS_KEY_ENV, tls.TLS_SERVER_NAME_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(auth.AUTH_ENV, TOKEN)
    monkeypatch.setenv("DATASERVICE_UNREACHABLE_TIMEOUT_MS", "20000")
    return monkeypatch


class _Service:
    """An in-process TLS dispatcher and `num_workers` TLS workers."""

    def __init__(self, certs: Certs, num_workers: int = 2, client_ca: str | None = None) -> None:
        self.dispatcher = ds.DispatchServer(
            ds.DispatcherConfig(
                auth_token=TOKEN,
                tls_cert_file=certs.server_cert,
                tls_key_file=certs.server_key,
                tls_client_ca_file=client_ca,
            )
        )
        self.workers = [
            ds.WorkerServer(
                ds.WorkerConfig(
                    self.dispatcher.target,
                    auth_token=TOKEN,
                    tls_cert_file=certs.server_cert,
                    tls_key_file=certs.server_key,
                    tls_client_ca_file=client_ca,
                    tls_ca_file=certs.ca,
                )
            )
            for _ in range(num_workers)
        ]
        deadline = time.monotonic() + 30
        for w in self.workers:
            assert w.wait_registered(max(0.1, deadline - time.monotonic())), (
                "worker did not register over TLS within 30 s"
            )

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.dispatcher.stop()


@pytest.fixture
def service(certs, env):
    s = _Service(certs)
    yield s
    s.stop()


def _read(target: str, mode, protocol: str | None, n: int = 100, job: str | None = None):
    dataset = ds.Dataset.range(n).apply(
        ds.distribute(mode, target, job_name=job, data_transfer_protocol=protocol)
    )
    it = iter(dataset)
    got = sorted(int(x) for x in it)
    used = {w["transfer_protocol"] for w in it.stats()["workers"].values()}
    return got, used


@pytest.mark.parametrize("mode", [ds.ShardingPolicy.OFF, ds.ShardingPolicy.DYNAMIC])
def test_data_flows_over_tls_grpc(service, certs, env, mode):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    got, used = _read(service.dispatcher.target, mode, "grpc")
    if mode == ds.ShardingPolicy.OFF:  # every worker produces the whole dataset
        assert got == sorted(list(range(100)) * 2)
    else:
        assert got == list(range(100))
    assert used == {"grpc"}


def test_shared_memory_still_used_on_the_same_host_with_tls(service, certs, env):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    got, used = _read(service.dispatcher.target, ds.ShardingPolicy.DYNAMIC, None)
    assert got == list(range(100))
    assert used == {"shm"}


def test_register_dataset_and_from_dataset_id_over_tls(service, certs, env):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    target = service.dispatcher.target
    dataset_id = ds.register_dataset(target, ds.Dataset.range(30))
    dataset = ds.from_dataset_id(
        ds.ShardingPolicy.DYNAMIC,
        target,
        dataset_id,
        ds.Dataset.range(30).element_spec,
        data_transfer_protocol="grpc",
    )
    assert sorted(int(x) for x in dataset) == list(range(30))


def test_plaintext_client_is_told_the_dispatcher_speaks_tls(service, env):
    start = time.monotonic()
    with pytest.raises(errors.UnavailableError) as info:
        _read(service.dispatcher.target, ds.ShardingPolicy.DYNAMIC, "grpc")
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "speaks TLS" in message and tls.TLS_CA_ENV in message, message
    assert service.dispatcher.target.split("://")[-1] in message
    # At first contact, not after the unreachable timeout (20 s here).
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_client_trusting_another_ca_gets_a_certificate_verify_error(service, other_certs, env):
    env.setenv(tls.TLS_CA_ENV, other_certs.ca)
    start = time.monotonic()
    with pytest.raises(errors.UnavailableError) as info:
        ds.register_dataset(service.dispatcher.target, ds.Dataset.range(3))
    message = str(info.value)
    assert "certificate verify failed" in message, message
    assert other_certs.ca in message, message
    assert time.monotonic() - start < 10


def test_tls_client_is_told_a_plaintext_dispatcher_does_not_speak_tls(certs, env):
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(auth_token=TOKEN))
    try:
        env.setenv(tls.TLS_CA_ENV, certs.ca)
        with pytest.raises(errors.UnavailableError, match="does not speak TLS"):
            ds.register_dataset(dispatcher.target, ds.Dataset.range(3))
    finally:
        dispatcher.stop()


def test_mutual_tls_refuses_a_client_without_a_certificate(certs, other_certs, env):
    service = _Service(certs, num_workers=1, client_ca=certs.ca)
    try:
        target = service.dispatcher.target
        env.setenv(tls.TLS_CA_ENV, certs.ca)
        with pytest.raises(errors.UnavailableError) as info:
            ds.register_dataset(target, ds.Dataset.range(3))
        assert "requires a client certificate" in str(info.value), str(info.value)
        assert "no client certificate" in str(info.value)
        # A certificate from another CA is refused too, and named.
        env.setenv(tls.TLS_CERT_ENV, other_certs.client_cert)
        env.setenv(tls.TLS_KEY_ENV, other_certs.client_key)
        with pytest.raises(errors.UnavailableError) as info:
            ds.register_dataset(target, ds.Dataset.range(3))
        assert other_certs.client_cert in str(info.value)
        # With one the server's CA signed, data flows (over gRPC and shm).
        env.setenv(tls.TLS_CERT_ENV, certs.client_cert)
        env.setenv(tls.TLS_KEY_ENV, certs.client_key)
        got, used = _read(target, ds.ShardingPolicy.DYNAMIC, "grpc", n=50)
        assert got == list(range(50)) and used == {"grpc"}
    finally:
        service.stop()


def test_the_token_is_still_required_over_tls(service, certs, env):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    env.setenv(auth.AUTH_ENV, "wrong-token")
    with pytest.raises(errors.UnauthenticatedError):
        ds.register_dataset(service.dispatcher.target, ds.Dataset.range(3))


def test_missing_or_bad_files_are_named_at_start(certs, tmp_path, env):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match="nope.pem"):
        ds.DispatchServer(ds.DispatcherConfig(tls_cert_file=missing, tls_key_file=certs.server_key))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="not.pem.*not a PEM file"):
        ds.DispatchServer(
            ds.DispatcherConfig(tls_cert_file=str(not_pem), tls_key_file=certs.server_key)
        )
    with pytest.raises(ValueError, match="both"):
        ds.DispatcherConfig(tls_cert_file=certs.server_cert)
    env.setenv(tls.TLS_CA_ENV, missing)
    with pytest.raises(ValueError, match=r"\$DATASERVICE_TLS_CA.*nope.pem"):
        ds.register_dataset("127.0.0.1:1", ds.Dataset.range(3))


def test_a_worker_serves_and_dials_tls_alike(certs, env):
    with pytest.raises(ValueError, match="would serve plaintext"):
        ds.WorkerServer(ds.WorkerConfig("127.0.0.1:1", tls_ca_file=certs.ca), start=False)
    with pytest.raises(ValueError, match="would talk plaintext"):
        ds.WorkerServer(
            ds.WorkerConfig(
                "127.0.0.1:1", tls_cert_file=certs.server_cert, tls_key_file=certs.server_key
            ),
            start=False,
        )


def test_no_clear_text_warning_when_tls_is_on(caplog):
    caplog.set_level(logging.WARNING, logger="dataservice.auth")
    auth.check_bind("worker", "0.0.0.0", TOKEN, False, tls=True)
    auth.warn_if_sent_in_clear("10.1.2.3:5050", TOKEN, tls=True)
    assert not [r for r in caplog.records if "clear" in r.getMessage()]
    auth.check_bind("worker", "0.0.0.0", TOKEN, False, tls=False)
    assert [r for r in caplog.records if "clear text" in r.getMessage()]


def test_cli_names_a_missing_tls_file_and_exits_2(tmp_path, certs):
    missing = str(tmp_path / "missing-key.pem")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataservice",
            "dispatcher",
            "--tls-cert",
            certs.server_cert,
            "--tls-key",
            missing,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "missing-key.pem" in proc.stderr and "--tls-key" in proc.stderr, proc.stderr


def test_local_cluster_serves_tls_through_its_configs(certs, env):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    with ds.LocalCluster(
        num_workers=2,
        dispatcher_config=ds.DispatcherConfig(
            tls_cert_file=certs.server_cert, tls_key_file=certs.server_key
        ),
        worker_options={
            "tls_cert_file": certs.server_cert,
            "tls_key_file": certs.server_key,
            "tls_ca_file": certs.ca,
        },
    ) as cluster:
        got, used = _read(cluster.target, ds.ShardingPolicy.DYNAMIC, "grpc", n=60)
        assert got == list(range(60)) and used == {"grpc"}
        assert tls.speaks_tls(cluster.target.split("://")[-1]) is True
        for address in cluster.worker_addresses:
            assert tls.speaks_tls(address.split("://")[-1]) is True


def test_a_certificate_for_another_name_is_named(service, certs, env):
    env.setenv(tls.TLS_CA_ENV, certs.ca)
    env.setenv(tls.TLS_SERVER_NAME_ENV, "not-in-the-certificate")
    with pytest.raises(errors.UnavailableError) as info:
        ds.register_dataset(service.dispatcher.target, ds.Dataset.range(3))
    message = str(info.value)
    assert "does not name 'not-in-the-certificate'" in message, message
    # A name the certificate holds passes, whatever host the address names.
    env.setenv(tls.TLS_SERVER_NAME_ENV, "dataservice")
    got, used = _read(service.dispatcher.target, ds.ShardingPolicy.DYNAMIC, "grpc", n=20)
    assert got == list(range(20)) and used == {"grpc"}


def test_cli_worker_without_tls_is_told_its_dispatcher_speaks_tls(service, env):
    env.delenv(auth.AUTH_ENV)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataservice",
            "worker",
            "--dispatcher",
            service.dispatcher.target,
            "--dispatcher-unreachable-timeout-ms",
            "30000",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, auth.AUTH_ENV: TOKEN},
    )
    assert proc.returncode == 1, proc.stderr
    assert "speaks TLS" in proc.stderr and "--tls-ca" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 25  # not the 30 s unreachable bound


def test_client_settings_refuse_half_a_pair_and_never_show_the_key(certs):
    with pytest.raises(ValueError, match=r"TLS_CERT is set but \$DATASERVICE_TLS_KEY"):
        tls.client_tls(environ={tls.TLS_CA_ENV: certs.ca, tls.TLS_CERT_ENV: certs.client_cert})
    with pytest.raises(ValueError, match="without a CA"):
        tls.client_tls(
            environ={tls.TLS_CERT_ENV: certs.client_cert, tls.TLS_KEY_ENV: certs.client_key}
        )
    assert tls.client_tls(environ={}) is None  # no CA: plaintext
    client = tls.client_tls(certs.ca, certs.client_cert, certs.client_key, environ={})
    assert client is not None and client.cert_file == certs.client_cert
    assert "PRIVATE KEY" not in repr(client) and "BEGIN" not in repr(client)


def test_status_over_tls_does_not_warn_that_the_token_goes_in_clear(
    service, certs, env, caplog, monkeypatch
):
    """`dataservice status` with a CA set speaks TLS: no clear-text token warning
    (it warned before it made its channel, so it never knew the channel's TLS);
    without one, its error names the TLS mismatch, as a trainer's does."""
    from dataservice import status

    env.setenv(tls.TLS_CA_ENV, certs.ca)
    # The dispatcher listens on loopback, where no warning is due anyway: take
    # its address for a remote one.
    monkeypatch.setattr(auth, "is_loopback_host", lambda host: False)
    caplog.set_level(logging.WARNING, logger="dataservice.auth")
    got = status.fetch_status(service.dispatcher.target, auth_token=TOKEN)
    assert len(got["workers"]) == 2
    assert not [r for r in caplog.records if "without TLS" in r.getMessage()]
    env.delenv(tls.TLS_CA_ENV)
    # Plaintext does warn, and its error names TLS at the first failed try, not
    # after the whole wait (was: "no answer ... within 30 s", then TLS after it).
    start = time.monotonic()
    with pytest.raises(errors.UnavailableError, match="speaks TLS and this client does not"):
        status.fetch_status(service.dispatcher.target, auth_token=TOKEN, timeout_s=30)
    assert time.monotonic() - start < 10
    assert [r for r in caplog.records if "without TLS" in r.getMessage()]
