"""The auth module itself: where the token comes from, constant-time compares,
the shared-memory challenge, the bind rules, and rate-limited refusal logs."""

from __future__ import annotations

import hmac
import logging
import os

import pytest

import dataservice as ds
from dataservice import auth


def test_resolve_token_order_config_then_file_then_env(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-file\n")
    path.chmod(0o600)
    env = {auth.AUTH_ENV: "from-env"}
    assert auth.resolve_token("from-config", None, env) == "from-config"
    assert auth.resolve_token(None, str(path), env) == "from-file"
    assert auth.resolve_token(None, None, env) == "from-env"
    assert auth.resolve_token(None, None, {}) is None
    assert auth.resolve_token("", None, {}) is None


def test_resolve_token_refuses_both_a_token_and_a_file(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        auth.resolve_token("a", str(tmp_path / "t"), {})
    with pytest.raises(ValueError, match="not both"):
        ds.DispatcherConfig(auth_token="a", auth_token_file=str(tmp_path / "t"))
    with pytest.raises(ValueError, match="not both"):
        ds.WorkerConfig("127.0.0.1:1", auth_token="a", auth_token_file=str(tmp_path / "t"))


def test_token_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="cannot read the auth token file .*missing"):
        auth.resolve_token(None, str(missing), {})
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        auth.resolve_token(None, str(empty), {})
    spaced = tmp_path / "spaced"
    spaced.write_text("two words")
    with pytest.raises(ValueError, match="without whitespace") as info:
        auth.resolve_token(None, str(spaced), {})
    assert "two words" not in str(info.value)  # the token never appears in a message


def test_token_file_readable_by_others_warns(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("t0ken")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        assert auth.read_token_file(str(path)) == "t0ken"
    assert "can be read by other users" in caplog.text


def test_token_file_readable_by_its_own_group_only_is_not_warned_of(tmp_path, caplog):
    # A Kubernetes secret mounted with fsGroup: root:<the process's group> 0440.
    path = tmp_path / "token"
    path.write_text("t0ken")
    os.chown(path, -1, os.getegid())
    path.chmod(0o440)
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        assert auth.read_token_file(str(path)) == "t0ken"
    assert "can be read by other users" not in caplog.text
    path.chmod(0o444)
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        auth.read_token_file(str(path))
    assert "can be read by other users" in caplog.text


def test_compares_go_through_hmac_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.tokens_equal("s3cret", "s3cret")
    assert not auth.tokens_equal("s3creT", "s3cret")
    assert not auth.tokens_equal("s3cret-and-more", "s3cret")
    assert auth.bearer_ok("Bearer s3cret", "s3cret")
    assert not auth.bearer_ok("Bearer wrong", "s3cret")
    challenge = auth.new_challenge()
    assert auth.challenge_ok("s3cret", challenge, auth.challenge_response("s3cret", challenge))
    assert not auth.challenge_ok("s3cret", challenge, auth.challenge_response("other", challenge))
    # Every comparison above went through the constant-time compare, on bytes.
    assert len(calls) == 7
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    assert not auth.tokens_equal(None, "s3cret")
    assert not auth.challenge_ok("s3cret", challenge, None)


def test_challenge_response_depends_on_token_and_challenge():
    c1, c2 = auth.new_challenge(), auth.new_challenge()
    assert c1 != c2 and len(c1) == 32
    r = auth.challenge_response("tok", c1)
    assert "tok" not in r and len(r) == 64
    assert r != auth.challenge_response("tok", c2)
    assert r != auth.challenge_response("tok2", c1)


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert auth.is_loopback_host(host) is loopback


def test_check_bind_rules(caplog):
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        auth.check_bind("dispatcher", "127.0.0.1", None, False)  # loopback: nothing to say
        assert caplog.text == ""
        with pytest.raises(ValueError, match=r"without an auth token.*--insecure"):
            auth.check_bind("dispatcher", "0.0.0.0", None, False)
        auth.check_bind("dispatcher", "0.0.0.0", None, True)
        assert "INSECURE" in caplog.text
        caplog.clear()
        auth.check_bind("worker", "0.0.0.0", "tok", False)
        assert "without TLS" in caplog.text and "clear text" in caplog.text


def test_servers_refuse_wildcard_bind_without_a_token(monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    with pytest.raises(ValueError, match="--insecure"):
        ds.DispatchServer(ds.DispatcherConfig(host="0.0.0.0"))
    with pytest.raises(ValueError, match="--insecure"):
        ds.WorkerServer(ds.WorkerConfig("127.0.0.1:1", host="0.0.0.0"))


def test_refusal_log_is_rate_limited_per_peer(caplog):
    log = auth.RefusalLog("dispatcher", interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        for _ in range(5):
            log.refused("ipv4:10.1.2.3:4000", "missing or wrong auth token", "10.1.2.3")
        log.refused("ipv4:10.9.9.9:4000", "missing or wrong auth token", "10.9.9.9")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "10.1.2.3:4000" in lines[0] and "10.9.9.9:4000" in lines[1]


def test_client_token_order(monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, "from-env")
    auth.register_token("127.0.0.1:5999", "registered")
    try:
        assert auth.client_token("127.0.0.1:5999", "explicit") == "explicit"
        assert auth.client_token("127.0.0.1:5999") == "registered"
        assert auth.client_token("grpc://localhost:5999") == "registered"
        assert auth.client_token("127.0.0.1:6000") == "from-env"
    finally:
        auth.unregister_token("127.0.0.1:5999")
    assert auth.client_token("127.0.0.1:5999") == "from-env"
    monkeypatch.delenv(auth.AUTH_ENV)
    assert auth.client_token("127.0.0.1:5999") is None


def test_new_token_is_random_and_long():
    a, b = auth.new_token(), auth.new_token()
    assert a != b and len(a) >= 40
    assert auth.check_token(a, "test") == a
    assert os.environ.get(auth.AUTH_ENV) != a


def test_cli_auth_flags_parse():
    from dataservice import cli

    parser = cli.build_parser()
    args = parser.parse_args(
        ["worker", "--dispatcher", "h:1", "--shm-allowed-uids", "5,6", "--insecure"]
        + ["--auth-token-file", "/run/token"]
    )
    assert (args.shm_allowed_uids, args.insecure, args.auth_token_file) == (
        [5, 6],
        True,
        "/run/token",
    )
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["worker", "--dispatcher", "h:1", "--shm-allowed-uids", "nobody"])
    assert info.value.code == 2


def test_a_token_sent_beyond_loopback_is_warned_of_once_per_address(caplog):
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        auth.warn_if_sent_in_clear("127.0.0.1:5050", "tok")  # loopback: fine
        auth.warn_if_sent_in_clear("10.7.7.7:5050", None)  # nothing sent
        assert caplog.records == []
        for _ in range(3):
            auth.warn_if_sent_in_clear("10.7.7.8:5050", "tok")
    assert len(caplog.records) == 1
    assert "10.7.7.8:5050 without TLS" in caplog.text
