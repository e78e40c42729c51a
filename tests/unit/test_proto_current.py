"""The checked-in generated gRPC/protobuf code matches its .proto files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RPC = ROOT / "python" / "dataservice" / "rpc"


def test_every_proto_has_its_generated_code_checked_in():
    """scripts/gen_proto.sh compiles every rpc/*.proto (service, example, journal, ...)."""
    protos = sorted(p.stem for p in RPC.glob("*.proto"))
    assert {"service", "example", "journal"} <= set(protos)
    for stem in protos:
        assert (RPC / f"{stem}_pb2.py").is_file(), f"{stem}_pb2.py: run scripts/gen_proto.sh"


@pytest.mark.timeout(120)
def test_generated_code_is_current(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the [test] extra")
    copy = tmp_path / "repo"
    (copy / "python" / "dataservice").mkdir(parents=True)
    shutil.copytree(ROOT / "python" / "dataservice" / "rpc", copy / "python/dataservice/rpc")
    shutil.copytree(ROOT / "scripts", copy / "scripts")
    for generated in (copy / "python/dataservice/rpc").glob("*_pb2*.py"):
        generated.unlink()
    subprocess.run(["bash", str(copy / "scripts/gen_proto.sh")], check=True, capture_output=True)
    checked_in = sorted(p.name for p in (ROOT / "python/dataservice/rpc").glob("*_pb2*.py"))
    regenerated = sorted(p.name for p in (copy / "python/dataservice/rpc").glob("*_pb2*.py"))
    assert regenerated == checked_in
    for name in checked_in:
        assert (copy / "python/dataservice/rpc" / name).read_text() == (
            ROOT / "python/dataservice/rpc" / name
        ).read_text(), f"{name} is stale: run scripts/gen_proto.sh"
