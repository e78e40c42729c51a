"""Fixtures of the integration tests that run one scenario under both harnesses
(`modes_common.py`): `harness` is `inprocess` (servers in this process) or
`processes` (worker processes of a `LocalCluster`, shared by a module's tests)."""

from __future__ import annotations

import pytest

from tests.integration.modes_common import InProcessHarness, ProcessClusters, ProcessHarness


@pytest.fixture(scope="module")
def process_clusters():
    clusters = ProcessClusters()
    yield clusters
    clusters.close()


@pytest.fixture(params=["inprocess", "processes"])
def harness(request, make_cluster, process_clusters):
    if request.param == "inprocess":
        return InProcessHarness(make_cluster)
    return ProcessHarness(process_clusters, request)
