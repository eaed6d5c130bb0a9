#!/usr/bin/env bash
# On the GPU machine, after the staging calls: install TE 2.20.2 + megatron-core 0.19.2, SGLang 0.5.17 and
# this project (as a wheel) into one site folder, /tmp/site. Idempotent; writes /tmp/quads_env.sh.
# QUADS_STACK=sglang: SGLang and the project only, from the sg carry (a/ + b/ + proj/) after stage.sh of sgk
# (sglang-kernel: sg with it and the tracked tree pass the 64 MiB a call carries); then
# QUADS_STACK=sglang with the sga carry adds the audio wheels `sglang.launch_server` imports (audio/).
# Each stack is installed once (a marker file per stack); a later full install adds TE to an SGLang-only one.
set -euo pipefail
S=/tmp/qstage SITE=/tmp/site
[ -d "${1:-}" ] && cp -a "$1"/. "$S"/   # the last carry (full/sN, sg or sga) is installed straight from the checkout
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"; }
STACK=${QUADS_STACK:-all}
if [ "$STACK" != sglang ] && [ ! -f "$SITE/.te_installed" ]; then
  core=/tmp/te_core/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
  mkdir -p /tmp/te_core && cat "$S"/te_core.part?? > "$core"   # pack_carries.py's parts, in stream order
  echo "30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e  $core" | sha256sum -c --quiet
  pipi "$core" "$S"/te/*.whl
  touch "$SITE/.te_installed"
fi
if [ ! -f "$SITE/.sglang_installed" ]; then
  ls "$S"/a/sglang_kernel-*.whl > /dev/null 2>&1 || { echo "install.sh: no sglang_kernel wheel staged: run stage.sh .dev/carry/sgk first (same warm machine)"; exit 2; }
  pipi "$S"/a/*.whl
  pipi "$S"/b/*.whl
  rm -rf "$SITE/IPython" && cp -r "$S/a/IPython_stub" "$SITE/IPython"
  touch "$SITE/.sglang_installed"
fi
if [ -d "$S/audio" ] && [ ! -f "$SITE/.audio_installed" ]; then   # sga after sg: what launch_server needs
  pipi "$S"/audio/*.whl
  touch "$SITE/.audio_installed"
fi
pipi "$S"/proj/*.whl   # always: the project may change between calls
cat > /tmp/quads_env.sh <<ENV
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 SGLANG_IS_FLASHINFER_AVAILABLE=false CUDA_HOME=/usr/local/cuda
export TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
ENV
. /tmp/quads_env.sh
python3 - <<'PY'
import torch, triton
import importlib, sglang, quads_megatron
v = {}
for name in ("transformer_engine", "megatron.core"):
    try:
        v[name] = importlib.import_module(name).__version__
    except ImportError:
        v[name] = "not installed"
print("installed: torch", torch.__version__, "triton", triton.__version__, "TE", v["transformer_engine"],
      "megatron-core", v["megatron.core"], "sglang", sglang.__version__, "quads_megatron", quads_megatron.__version__,
      "from", quads_megatron.__file__)
PY
