#!/usr/bin/env bash
# Regenerates the Python code of every python/dataservice/rpc/*.proto:
#   xxx.proto -> xxx_pb2.py, and xxx_pb2_grpc.py when it declares a service.
# Generated files are checked in and never edited by hand; run this after changing a .proto:
#   scripts/gen_proto.sh            (needs grpcio-tools: pip install grpcio-tools)
# Protos are compiled with `-I python`, so they are named dataservice/rpc/xxx.proto and one
# proto imports another as `import "dataservice/rpc/other.proto";`; the generated code then
# imports it as `from dataservice.rpc import other_pb2`. Any bare `import other_pb2` a
# differently written import would produce is rewritten to that form.
set -euo pipefail

cd "$(dirname "$0")/.."
root=python
pkg_dir=dataservice/rpc
shopt -s nullglob
protos=("$root/$pkg_dir"/*.proto)
if [ ${#protos[@]} -eq 0 ]; then
  echo "no .proto files in $root/$pkg_dir" >&2
  exit 1
fi

for proto in "${protos[@]}"; do
  rel=${proto#"$root/"}
  base=${proto%.proto}
  grpc_out=()
  if grep -Eq '^[[:space:]]*service[[:space:]]' "$proto"; then
    grpc_out=(--grpc_python_out="$root")
  fi
  python -m grpc_tools.protoc -I "$root" --python_out="$root" "${grpc_out[@]}" "$rel"
  for generated in "${base}_pb2.py" "${base}_pb2_grpc.py"; do
    [ -f "$generated" ] || continue
    sed -i -E 's/^import ([A-Za-z0-9_]+_pb2)( as |$)/from dataservice.rpc import \1\2/' "$generated"
  done
  echo "generated from $proto"
done
