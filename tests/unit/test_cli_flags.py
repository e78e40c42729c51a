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
