"""A `DispatcherConfig` survives the trip `LocalCluster` makes it take: its
fields as CLI flags (`cluster._config_flags`), parsed back by the dispatcher
subcommand. `worker_addresses=None` (no fixed list) and `[]` (a fixed list
of zero workers) must stay different."""

from __future__ import annotations

import argparse

import pytest

from dataservice import cli
from dataservice.cluster import _config_flags
from dataservice.config import DispatcherConfig


def round_trip(config: DispatcherConfig) -> DispatcherConfig:
    args = cli.build_parser().parse_args(["dispatcher", *_config_flags(config)])
    return DispatcherConfig(**cli._config_kwargs(args, DispatcherConfig))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "worker_addresses", [None, [], ["a:1"], ["a:1", "b:2"], ["127.0.0.1:%port%"] * 2]
)
def test_worker_addresses_round_trip(worker_addresses):
    config = DispatcherConfig(worker_addresses=worker_addresses)
    assert round_trip(config).worker_addresses == worker_addresses


@pytest.mark.timeout(30)
def test_empty_value_is_the_empty_list_and_commas_alone_are_an_error(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["dispatcher", "--worker-addresses", ""]).worker_addresses == []
    assert not hasattr(parser.parse_args(["dispatcher"]), "worker_addresses")
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["dispatcher", "--worker-addresses", " , "])
    assert exit_info.value.code == 2
    assert "comma-separated list" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        cli._comma_list(",")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--timeout-s", "0"], "--timeout-s must be in (0, 86400], got 0.0"),
        (["--timeout-s", "-1"], "--timeout-s must be in (0, 86400], got -1.0"),
        (["--timeout-s", "nan"], "--timeout-s must be in (0, 86400], got nan"),
        (["--window-s", "0"], "--window-s must be in (0, 86400], got 0.0"),
        (["--watch", "--interval-s", "0"], "--interval-s must be positive, got 0.0"),
    ],
)
def test_status_refuses_nonpositive_durations_before_any_rpc(capsys, flags, message):
    # Port 9 (discard) on loopback: nothing answers, so reaching an RPC would
    # fail differently (exit 1, "unreachable"), not as a usage error.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["status", "--dispatcher", "127.0.0.1:9", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["dispatcher", "worker"])
def test_metrics_port_help_tells_how_the_endpoint_is_guarded(capsys, kind):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([kind, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "has no auth" not in text
    flag_help = text[text.index("--metrics-port N Serve") :][:700]
    assert "Bearer" in flag_help and "HTTPS" in flag_help and "client certificate" in flag_help
