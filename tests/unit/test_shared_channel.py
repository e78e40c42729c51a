"""`rpc.util.shared_channel`: one channel per address, TLS settings and options for the
whole process, never shared with a forked child."""

from __future__ import annotations

import os

from dataservice.rpc import util
from tests.tls_certs import make_certs


def test_one_channel_per_address_and_options() -> None:
    a = util.shared_channel("127.0.0.1:1")
    assert util.shared_channel("127.0.0.1:1") is a
    assert util.shared_channel("127.0.0.1:2") is not a
    data = util.shared_data_channel("127.0.0.1:1")
    assert data is not a  # keepalive options: another channel
    assert util.shared_data_channel("127.0.0.1:1") is data


def test_a_forked_child_makes_its_own(monkeypatch) -> None:
    a = util.shared_channel("127.0.0.1:3")
    monkeypatch.setattr(util, "_SHARED_PID", os.getpid() + 1)  # as a forked child sees it
    b = util.shared_channel("127.0.0.1:3")
    assert b is not a
    assert util.shared_channel("127.0.0.1:3") is b


def test_tls_settings_are_part_of_the_key(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("DATASERVICE_TLS_CA", raising=False)
    plain = util.shared_channel("127.0.0.1:4")
    assert not util.channel_uses_tls("127.0.0.1:4")
    certs = make_certs(str(tmp_path))
    monkeypatch.setenv("DATASERVICE_TLS_CA", certs.ca)
    tls_channel = util.shared_channel("127.0.0.1:4")
    assert tls_channel is not plain
    assert util.channel_uses_tls("127.0.0.1:4")
    other = make_certs(str(tmp_path / "other"), ca_name="another CA")
    monkeypatch.setenv("DATASERVICE_TLS_CA", other.ca)
    assert util.shared_channel("127.0.0.1:4") not in (plain, tls_channel)  # another CA
    monkeypatch.delenv("DATASERVICE_TLS_CA")
    assert util.shared_channel("127.0.0.1:4") is plain
    assert not util.channel_uses_tls("127.0.0.1:4")
