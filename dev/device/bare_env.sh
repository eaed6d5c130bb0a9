# Sourced by the bare-machine scripts (bare_decode.sh, bare_prefill.sh, bare_rac.sh) from the checkout's root,
# with the script's SECONDS as $1: the machine's own torch and Triton on this checkout's src/ (and benchmarks/), $OUT,
# the GPU's name and versions in $OUT/gpu.txt, and `part NAME SHARE CMD...`: CMD under a timeout of SHARE% of
# SECONDS (default 540), logged to $OUT/NAME.log, one summary line.
export TRITON_INTERPRET=0 PYTHONPATH="$PWD/src:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
budget=${1:-540}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"
part() { local name=$1 share=$2; shift 2; local t0; t0=$(date +%s)
  timeout $((budget * share / 100)) "$@" > "$OUT/$name.log" 2>&1; echo "$name: rc $? in $(( $(date +%s) - t0 )) s"; }
