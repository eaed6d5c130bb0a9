#!/usr/bin/env bash
# On the GPU machine, after install.sh: run parts of the GPU checks and benchmarks, each with its own timeout,
# each logging to $OUT/<part>.log (at most 8 files come back per call), one summary line per part.
#   bash dev/device/run.sh PART[:SECONDS] ...      parts: cuda te engine server sync block pieces gemm tiles
#                                                   triton-tiles mma-tiles act-tiles engine-bench rl rl-smoke
#                                                   rl-test cpu
# tiles / triton-tiles / mma-tiles / act-tiles sweep the Gluon wgmma GEMM's, the Triton GEMM's, the decode-size
# Gluon GEMM's and the activation quantization's tiles on this GPU (dev/probe_*_tiles.py --write-config; act-tiles:
# fc1's and fc2's gated quantization in one sweep; arguments from TILES_ARGS, e.g. "--gemm fc2" for the GEMMs' fc2
# rules, and ACT_TILES_ARGS) and, when the sweep finished, copy the rewritten configs/*.json to $OUT. Each call
# starts from the checkout's files: copy $OUT's json into src/quads_megatron/kernels/configs/ before a later call
# sweeps more (fc2 after fc1), and commit them from there. A GEMM sweep of fc1 also moves fc2's rules that still
# hold the same tile (dev/tile_writer.py); `--gemm fc2` then tunes fc2's own (mma-tiles sweeps both). The sweeps
# time tiles given explicitly; parts that run later in the same call use the installed (untuned) files, unless
# QUADS_FROM_TREE=1: then quads_megatron is imported from this checkout's src/, where the sweeps write.
# engine is the engine test without the README server command (~7.5 min), server that one alone (~4 min; needs
# the sga carry's audio wheels). engine-bench, block and pieces take extra arguments from BENCH_ENGINE_ARGS,
# BLOCK_ARGS and PIECES_ARGS. engine-bench's fp8_tuned arm serves the tuned SGLang configs block's tuned arms
# write to $OUT: run block first in the same call (e.g. BLOCK_ARGS="--arms ours,sglang_fp8,sglang_fp8_tuned,
# sglang_fp8_tensor,sglang_fp8_tensor_tuned"), then BENCH_ENGINE_ARGS="--arms fp8,fp8_tuned --peer-configs
# $OUT/sglang_fp8_tensor_tuned.json ..."; SGLang takes the tuned entry nearest each forward's token count, so tune
# the block up to the engine's prefill sizes too (--tokens 16,64,256,1024,4096,16384; bench_engine warns where a
# file stops short). Give an arm 200 s or more: a fresh machine's first engine start took 130-148 s.
# rl runs one resumable piece of the `quads rl` study in $RL_RUN (default /tmp/rl_run; kept while the machine
# stays warm) with arguments from RL_ARGS, its budget SECONDS - 90; call it again to resume. rl-smoke (e.g.
# rl-smoke:330): the study of tests/gpu/test_rl_gpu.py (arms bf16, naive, quads for 3 steps on a 2-layer
# model) in /tmp/rl_smoke, budget SECONDS - 60; it resumes too, and rl-test
# then checks that directory (resuming it if needed). rl copies the summary (rl_summary.md/.json, plots) and timing.json to
# $OUT, rl-smoke its rl_summary.md/.json to $OUT/smoke (few files come back per call).
set -u
. /tmp/quads_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."   # the checkout: tests/ and benchmarks/ from here, quads_megatron from /tmp/site
# QUADS_FROM_TREE=1: quads_megatron from this checkout's src/ (the tree this call carried), not the installed wheel
# (code changed since the wheel was built runs without a new carry)
[ "${QUADS_FROM_TREE:-0}" = 1 ] && export PYTHONPATH="$PWD/src:$PYTHONPATH"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
pt() { python3 -m pytest -q -rs -p no:cacheprovider -p no:warnings "$@"; }
for spec in "$@"; do
  part=${spec%%:*}; secs=${spec#*:}; [ "$secs" = "$spec" ] && secs=540
  log="$OUT/$part.log"; t0=$(date +%s)
  case "$part" in
    cuda) timeout "$secs" bash -c "$(declare -f pt); pt tests/test_gpu_cuda.py" > "$log" 2>&1 ;;
    te) timeout "$secs" bash -c "$(declare -f pt); pt tests/gpu/test_te_qat.py tests/gpu/test_te_calibration.py" > "$log" 2>&1 ;;
    engine) OUT="$OUT" timeout "$secs" bash -c "$(declare -f pt); pt -s tests/gpu/test_sglang_engine.py -k 'not launch_server'" \
          > "$log" 2>&1 ;;
    server) OUT="$OUT" timeout "$secs" bash -c "$(declare -f pt); pt -s tests/gpu/test_sglang_engine.py -k launch_server" \
          > "$log" 2>&1 ;;
    sync) timeout "$secs" bash -c "$(declare -f pt); pt -s tests/gpu/test_live_sync.py" > "$log" 2>&1 ;;
    block) timeout "$secs" python3 benchmarks/bench_moe_block.py --out "$OUT" ${BLOCK_ARGS:-} > "$log" 2>&1 ;;
    pieces) timeout "$secs" python3 dev/probe_block_pieces.py --out "$OUT" ${PIECES_ARGS:-} > "$log" 2>&1 ;;
    gemm) timeout "$secs" python3 benchmarks/bench_moe_w4a4.py --out "$OUT" > "$log" 2>&1 ;;
    tiles) timeout "$secs" python3 dev/probe_wgmma_tiles.py --write-config --budget-s $((secs - 60)) ${TILES_ARGS:-} \
          > "$log" 2>&1
        rc=$?; [ $rc -eq 0 ] && cp src/quads_megatron/kernels/configs/wgmma_gemm.json "$OUT"/; (exit $rc) ;;
    triton-tiles) timeout "$secs" python3 dev/probe_gemm_tiles.py --write-config --budget-s $((secs - 60)) \
          ${TILES_ARGS:-} > "$log" 2>&1
        rc=$?; [ $rc -eq 0 ] && cp src/quads_megatron/kernels/configs/triton_gemm.json "$OUT"/; (exit $rc) ;;
    mma-tiles) timeout "$secs" python3 dev/probe_mma_tiles.py --write-config --budget-s $((secs - 60)) ${TILES_ARGS:-} \
          > "$log" 2>&1
        rc=$?; [ $rc -eq 0 ] && cp src/quads_megatron/kernels/configs/mma_gemm.json "$OUT"/; (exit $rc) ;;
    act-tiles) timeout "$secs" python3 dev/probe_act_quant_tiles.py --write-config ${ACT_TILES_ARGS:-} > "$log" 2>&1
        rc=$?; [ $rc -eq 0 ] && cp src/quads_megatron/kernels/configs/act_quant.json "$OUT"/; (exit $rc) ;;
    engine-bench) timeout "$secs" python3 benchmarks/bench_engine.py --out "$OUT" ${BENCH_ENGINE_ARGS:-} > "$log" 2>&1 ;;
    rl) run=${RL_RUN:-/tmp/rl_run}
        timeout "$secs" python3 -m quads_megatron.cli rl --out "$run" --budget-s $((secs - 90)) ${RL_ARGS:-} > "$log" 2>&1
        rc=$?; cp "$run"/summary/rl_* "$run"/timing.json "$OUT"/ 2>/dev/null; (exit $rc) ;;
    rl-smoke) timeout "$secs" python3 -m quads_megatron.cli rl --out /tmp/rl_smoke --model smoke \
          --arms main --steps 3 --sft-steps 20 --prompts 8 --group 4 --digits 3 \
          --budget-s $((secs - 60)) > "$log" 2>&1
        rc=$?; mkdir -p "$OUT/smoke"; cp /tmp/rl_smoke/summary/rl_summary.* "$OUT/smoke/" 2>/dev/null; (exit $rc) ;;
    rl-test) QUADS_RL_RUN_DIR=/tmp/rl_smoke timeout "$secs" bash -c "$(declare -f pt); pt -s tests/gpu/test_rl_gpu.py" \
          > "$log" 2>&1 ;;
    cpu) CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout "$secs" bash -c "$(declare -f pt); pt tests --ignore=tests/gpu" > "$log" 2>&1 ;;
    *) echo "unknown part $part" > "$log"; false ;;
  esac
  rc=$?
  echo "== $part: rc=$rc in $(( $(date +%s) - t0 )) s; $(grep -E 'passed|failed|error|Error' "$log" | tail -1 | cut -c1-200)"
done
