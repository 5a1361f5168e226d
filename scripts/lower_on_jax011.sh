#!/usr/bin/env bash
# The Mosaic GPU kernels' cross-lowering tests under jax 0.11 on this CPU machine, before a GPU call.
#
#   bash scripts/lower_on_jax011.sh                 # every "lower" and "interpret" test of the Mosaic GPU kernels
#   bash scripts/lower_on_jax011.sh -k fp8          # extra pytest arguments narrow them
#
# Why: CI and the default venv run jax 0.10 (Python 3.11), whose Mosaic GPU lowering stops before
# layout inference.  jax 0.11 (the GPU's version; Python >= 3.12) infers the register layouts and
# shared-memory transforms while lowering, so a kernel it cannot compile ("Failed to infer a
# possible set of layouts") fails here in a minute instead of on the device; and jax 0.11's GPU
# interpreter runs both kernels against their references (shared memory, TMA and barriers simulated,
# "races" cases with race detection), which jax 0.10 cannot.  The venv is built once
# under $UMEM_JAX011_VENV (default /tmp/umem_jax011) from PyPI; nothing here is installed for CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${UMEM_JAX011_VENV:-/tmp/umem_jax011}
PY=
for c in python3.12 python3.13; do  # a pyenv shim may name a version it does not run: try each
  if command -v "$c" > /dev/null && "$c" -c "" 2> /dev/null; then PY=$(command -v "$c"); break; fi
  if command -v pyenv > /dev/null; then  # pyenv's own copy of that version, outside the global one
    v=$(pyenv versions --bare 2> /dev/null | grep "^${c#python}" | tail -1)
    if [ -n "$v" ] && [ -x "$(pyenv root)/versions/$v/bin/$c" ]; then PY="$(pyenv root)/versions/$v/bin/$c"; break; fi
  fi
done
if [ -z "$PY" ]; then
  echo "needs python3.12 or newer (jax 0.11 requires it)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "jax==0.11.2" "jaxlib==0.11.2" numpy pytest ml_dtypes
fi
JAX_PLATFORMS=cpu PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/kernels/test_paged_decode_mgpu.py tests/kernels/test_paged_decode_mgpu_interpret.py \
  tests/kernels/test_paged_prefill_mgpu.py -k "lower or interpret" "$@"
