#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what the GPU check's FlashInfer command carries to the GPU machine
# (Python 3.12, no network; docs/benchmarks.md, "GPU check"). The Triton command carries nothing.
#
#   flashinfer-0.7.2-slim.tar.xz   flashinfer-python 0.7.2 installed (pure Python, its JIT sources and
#                                  headers), less what paged attention never compiles: the kernel
#                                  folders under data/csrc (MoE, sampling, KDA, GDN, FMHA variants)
#                                  and the tuning JSONs over 200 kB. The wheel itself is 65 MB,
#                                  too much beside the repository in one call's 64 MiB.
#   apache_tvm_ffi-*.whl           its one dependency the machine lacks (einops, nvidia-ml-py, ninja,
#                                  cuda-bindings, torch are there; KINDS.md)
#
# Run from anywhere with a pip that reaches PyPI: bench/gpu_check_pack.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
FLASHINFER=flashinfer-python==0.7.2
TVM_FFI=apache-tvm-ffi==0.1.15.post2
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .whl
rm -f .whl/flashinfer-*-slim.tar.xz .whl/apache_tvm_ffi-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$work/wheels" "$FLASHINFER"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .whl "$TVM_FFI"
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$work/tree" "$work"/wheels/flashinfer_python-*.whl
find "$work/tree/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
find "$work/tree/flashinfer" -name "*.json" -size +200k -delete
(cd "$work/tree" && tar -cf - flashinfer flashinfer_python-*.dist-info) | xz -T0 -6 > .whl/flashinfer-0.7.2-slim.tar.xz
ls -l .whl
