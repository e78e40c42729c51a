"""User-defined numpy dtypes (ml_dtypes' bfloat16, float8_e4m3fn, int4) keep their
dtype through the service, over shared memory and gRPC: the frame names them
(`dtype.name`; their `dtype.str` is only "<V2"), and a consumer that never
imported ml_dtypes gets them too (the decoder imports it). They came back as
void arrays (`|V2`), their values unreadable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dataservice as ds
from tests.conftest import InProcessCluster

ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = pytest.mark.timeout(120)


def _element(i: int) -> dict:
    import ml_dtypes  # in the pipeline: the worker's process imports it

    return {
        "bf16": np.array([[1.5, i], [-2.25, 0.0]], ml_dtypes.bfloat16),
        "f8": np.array([1.5, i, 448.0], ml_dtypes.float8_e4m3fn),
        "i4": np.array([1, -i, 7], ml_dtypes.int4),
        "scalar": ml_dtypes.bfloat16(i + 0.5),
        "plain": np.float32(i),
    }


@pytest.mark.parametrize("protocol", ["shm", "grpc"])
def test_ml_dtypes_come_back_with_their_dtype_and_bytes(protocol: str) -> None:
    s = InProcessCluster(1)
    try:
        dataset = (
            ds.Dataset.range(4)
            .map(lambda i: _element(int(i)))
            .apply(
                ds.distribute(
                    ds.ShardingPolicy.OFF, s.dispatcher.target, data_transfer_protocol=protocol
                )
            )
        )
        got = list(dataset)
    finally:
        s.stop()
    assert len(got) == 4
    for i, element in enumerate(got):
        want = _element(i)
        assert sorted(element) == sorted(want)
        for key, value in want.items():
            value = np.asarray(value)
            out = np.asarray(element[key])
            assert out.dtype == value.dtype, (key, out.dtype, value.dtype)
            assert out.shape == value.shape and out.tobytes() == value.tobytes(), key
        assert float(element["bf16"][0, 1]) == float(i)
        assert float(element["f8"][2]) == 448.0
        assert int(element["i4"][1]) == -i


_CONSUMER = """
import sys
import numpy as np
import dataservice as ds

def element(i):
    import ml_dtypes
    return np.array([1.5, i], ml_dtypes.bfloat16)

assert "ml_dtypes" not in sys.modules, "imported before reading: the test shows nothing"
with ds.LocalCluster(num_workers=1) as cluster:
    dataset = ds.Dataset.range(3).map(lambda i: element(int(i))).apply(
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target, data_transfer_protocol=sys.argv[1]))
    got = list(dataset)
print(got[2].dtype.name, float(got[2][0]), float(got[2][1]))
"""


@pytest.mark.parametrize("protocol", ["shm", pytest.param("grpc", marks=pytest.mark.slow)])
def test_a_consumer_that_never_imported_ml_dtypes_gets_them(protocol: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CONSUMER), protocol],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["bfloat16", "1.5", "2.0"]
