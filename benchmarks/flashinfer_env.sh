# Source this on the GPU machine (no network) to make vendored FlashInfer importable:
#
#   source benchmarks/flashinfer_env.sh && python3 ...
#
# Installs vendor/flashinfer/*.whl (see benchmarks/vendor_flashinfer.sh; carry
# "vendor/flashinfer" with the run) into a target directory with --no-deps, so the
# image's torch 2.11 and every other package stay as they are, and exports:
#   PYTHONPATH                the repo, then the target directory
#   PATH                      ninja from the vendored wheel when the image has none
#   FLASHINFER_WORKSPACE_BASE where FlashInfer keeps its JIT-built kernels (.cache/flashinfer/...)
# Idempotent: a second source in the same machine session reuses the install and the kernels.
_fi_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FI_VENDOR="${FI_VENDOR:-$_fi_repo/vendor/flashinfer}"
FI_SITE="${FI_SITE:-/tmp/dcp_fi_site}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/dcp_fi_jit}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ ! -d "$FI_SITE/flashinfer" ]; then
    _fi_wheel="$(ls "$FI_VENDOR"/flashinfer_python-*.whl 2>/dev/null | head -n 1)"
    if [ -z "$_fi_wheel" ]; then
        echo "flashinfer_env: no flashinfer wheel in $FI_VENDOR (carry vendor/flashinfer)" >&2
    else
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FI_SITE" \
            "$_fi_wheel" || echo "flashinfer_env: pip install of $_fi_wheel failed" >&2
    fi
fi
if ! command -v ninja >/dev/null 2>&1; then
    if [ ! -x "$FI_SITE/bin/ninja" ]; then
        _fi_ninja="$(ls "$FI_VENDOR"/ninja-*.whl 2>/dev/null | head -n 1)"
        [ -n "$_fi_ninja" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$FI_SITE" "$_fi_ninja"
    fi
    export PATH="$FI_SITE/bin:$PATH"
fi
export PYTHONPATH="$_fi_repo:$FI_SITE${PYTHONPATH:+:$PYTHONPATH}"
unset _fi_repo _fi_wheel _fi_ninja
