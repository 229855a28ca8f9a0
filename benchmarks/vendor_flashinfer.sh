#!/usr/bin/env bash
# Fill vendor/flashinfer/ (git-ignored) with what the H200 machine needs to run
# attn_backend="flashinfer" offline. Run HERE, where PyPI is reachable.
#
#   flashinfer-python 0.2.14.post1: downloaded as its source package (3.6 MB, JIT kernels)
#     and built into a pure-Python wheel (about 5.4 MB: Python code plus the CUDA/C++
#     sources and CUTLASS headers that nvcc compiles there on first use). Nothing is
#     compiled here; the build needs setuptools>=77 and packaging>=24 (no torch, no CUDA).
#   ninja (about 0.2 MB): a fallback; the GPU image has ninja already.
#
# Everything else FlashInfer 0.2.14 imports on the MLA path (torch, numpy, jinja2,
# filelock, requests, packaging, pynvml via nvidia-ml-py, einops) is in the GPU image;
# its cuda-python<=12.9 and nvidia-cudnn-frontend requirements are not needed by the MLA
# path and are skipped (install with --no-deps). See benchmarks/flashinfer_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${FLASHINFER_VERSION:-0.2.14.post1}"
DEST=vendor/flashinfer
mkdir -p "$DEST"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download --no-deps --no-build-isolation -d "$tmp" "flashinfer-python==$VERSION"
python3 -m pip wheel --no-deps --no-build-isolation -w "$DEST" "$tmp"/flashinfer_python-*.tar.gz
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DEST" "ninja==1.13.0"
ls -la "$DEST"
du -sh "$DEST"
