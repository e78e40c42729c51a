#!/usr/bin/env bash
# Builds the release wheel and checks that it works on its own:
#   1. `maturin build --release` -> one abi3 manylinux wheel (cp311-abi3: every CPython >= 3.11);
#   2. a clean venv (no system site-packages) pip-installs that wheel and its dependencies
#      from the package index (PyPI), plus the `image` extra for the demo;
#   3. from a directory outside the source tree (so `import dataservice` can only find the
#      installed wheel), it runs a tiny `dataservice demo` and a smoke test: a LocalCluster of
#      two worker processes, one DYNAMIC epoch read over shared memory and one over gRPC,
#      each element exactly once.
# Usage: scripts/build_wheel_check.sh [--no-demo]
# Env: CARGO_TARGET_DIR (default target/), WHEEL_CHECK_DIR (default a fresh mktemp -d),
#      PYTHON (default python3: the interpreter that builds the wheel and makes the venv).
# Prints each step's time and, last, "wheel check passed in N s".
set -euo pipefail

cd "$(dirname "$0")/.."
repo=$(pwd)
demo=1
[ "${1:-}" = "--no-demo" ] && demo=0
python=${PYTHON:-python3}
work=${WHEEL_CHECK_DIR:-$(mktemp -d /tmp/ds-wheel-check.XXXXXX)}
mkdir -p "$work"
start=$(date +%s)
step() { echo "[$(($(date +%s) - start)) s] $*"; }

step "building the wheel (maturin build --release) into $work/dist"
"$python" -m maturin build --release --out "$work/dist" >"$work/build.log" 2>&1 || {
  tail -40 "$work/build.log" >&2
  exit 1
}
wheels=("$work"/dist/dataservice-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
  echo "expected one wheel in $work/dist, found: ${wheels[*]}" >&2
  exit 1
fi
wheel=${wheels[0]}
step "built $(basename "$wheel")"
case "$(basename "$wheel")" in
  *-cp311-abi3-manylinux*.whl) ;;
  *)
    echo "the wheel is not a cp311-abi3 manylinux wheel (one wheel for every CPython >= 3.11):" \
      "$(basename "$wheel")" >&2
    exit 1
    ;;
esac

step "installing it into a clean venv $work/venv"
"$python" -m venv "$work/venv"
venv_py=$work/venv/bin/python
extra=""
[ $demo = 1 ] && extra="[image]"
"$venv_py" -m pip install --quiet "${wheel}${extra}" >"$work/install.log" 2>&1 || {
  tail -40 "$work/install.log" >&2
  exit 1
}
step "installed"

# Outside the source tree, with no PYTHONPATH: only the installed wheel can be imported.
mkdir -p "$work/run"
cd "$work/run"
export -n PYTHONPATH 2>/dev/null || true
unset PYTHONPATH
where=$("$venv_py" -c "import dataservice, os; print(os.path.dirname(dataservice.__file__))")
case "$where" in
  "$work/venv"/*) ;;
  *)
    echo "dataservice was imported from $where, not from the venv's wheel" >&2
    exit 1
    ;;
esac
case "$where" in "$repo"/*)
  echo "dataservice was imported from the source tree ($where)" >&2
  exit 1
  ;;
esac

if [ $demo = 1 ]; then
  step "dataservice demo (64 records, 1 epoch)"
  "$work/venv/bin/dataservice" demo --workers 1 --epochs 1 --num-records 64 --batch-size 16 \
    --data-dir "$work/demo-images" --no-dataloader --json --no-progress \
    >"$work/demo.out" 2>"$work/demo.err" || {
    tail -30 "$work/demo.err" >&2
    exit 1
  }
  tail -1 "$work/demo.out"
fi

step "smoke test: LocalCluster, a DYNAMIC epoch over shm and one over gRPC"
"$venv_py" - <<'EOF'
import dataservice as ds

with ds.LocalCluster(num_workers=2) as cluster:
    for protocol, transport in ((None, "shm"), ("grpc", "grpc")):
        dataset = ds.Dataset.range(200).apply(
            ds.distribute(
                ds.ShardingPolicy.DYNAMIC,
                cluster.dispatcher_address,
                job_name=f"smoke-{transport}",
                data_transfer_protocol=protocol,
            )
        )
        it = iter(dataset)
        got = sorted(int(x) for x in it)
        assert got == list(range(200)), f"{transport}: {len(got)} elements, not 0..199 once each"
        used = {w["transfer_protocol"] for w in it.stats()["workers"].values()}
        print(transport, "epoch ok; transports:", sorted(used))
        assert used == {transport}, f"expected {transport} transport, stats say {used}"
EOF
rm -rf "$work/venv" "$work/demo-images"
step "wheel check passed in $(($(date +%s) - start)) s (wheel: $wheel)"
