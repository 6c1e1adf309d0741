#!/usr/bin/env bash
# Regenerate the Python gRPC/protobuf modules from proto/ into fedsched/api/ (committed).
# Needs grpcio-tools (the `test` extra). tests/unit/fedsched/test_proto_current.py checks they are current.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. \
  $(find proto -name '*.proto' | sort)
