#!/usr/bin/env bash
# Run HERE (a machine with a registry): lay out the carries for the GPU machine under .dev/carry/.
#   full/s0..sN: the full stack (Transformer Engine's core wheel in parts, TE's Python wheels, megatron-core
#           0.19.2, SGLang sets a and b, the project), packed by dev/device/pack_carries.py so that each carry
#           and the working tree fit one call's 64 MiB (the core is cut to fill what the wheels leave); the
#           last one, sN, holds the project: stage.sh s0 .. s(N-1), then install.sh sN
#   sgk:    sglang-kernel alone (stage.sh .dev/carry/sgk first: sg with it and the tracked tree pass 64 MiB)
#   sg:     SGLang sets a (without sglang-kernel, and without soundfile and its cffi: audio only, imported
#           lazily) and b + the project: with sgk staged, the SGLang-only stack (QUADS_STACK=sglang); TE can
#           be added to it later by staging full/s0..sN and installing sN
#   sga:    the three audio wheels sg leaves out (soundfile, cffi, pycparser): `sglang.launch_server` imports
#           soundfile at start, the Engine does not; install.sh .dev/carry/sga adds them to an sg stack
# Inputs: .dev/te/p0..p4 (../shared/device/fetch_te_core.sh .dev/te), .dev/sgl/{a,b}
# (../shared/device/build_sglang_wheels.sh .dev/sgl), the TE wheel folder (TE_WHEELS, default ../shared/device/te-2.20.2).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
TE_WHEELS=${TE_WHEELS:-../shared/device/te-2.20.2}
C=.dev/carry
rm -rf "$C" && mkdir -p "$C/proj" "$C/core"
core=$C/core/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
cat .dev/te/p{0,1,2,3,4}/te_core.part* > "$core"
echo "30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e  $core" | sha256sum -c --quiet
python3 -m pip wheel -q --no-deps -w "$C/proj" . 2>&1 | grep -v "^WARNING: Location" || true
items=()
for w in "$TE_WHEELS"/transformer_engine-*.whl "$TE_WHEELS"/transformer_engine_torch-*.whl \
         "$TE_WHEELS"/megatron_core-*.whl "$TE_WHEELS"/typing_extensions-*.whl; do items+=(--item "te=$w"); done
for w in .dev/sgl/a/*.whl; do items+=(--item "a=$w"); done
for f in .dev/sgl/a/IPython_stub/*; do items+=(--item "a/IPython_stub=$f"); done
for w in .dev/sgl/b/*.whl; do items+=(--item "b=$w"); done
python3 dev/device/pack_carries.py "$C/full" --core "$core" "${items[@]}" --proj "$C"/proj/*.whl
rm -rf "$C/core"
mkdir -p "$C/sg/a" "$C/sg/b"
cp -r .dev/sgl/a/. "$C/sg/a/" && rm -f "$C"/sg/a/{soundfile,cffi,pycparser}-*.whl
mkdir -p "$C/sgk/a" && mv "$C"/sg/a/sglang_kernel-*.whl "$C/sgk/a/"
cp .dev/sgl/b/*.whl "$C/sg/b/"
mkdir -p "$C/sga/audio" && cp .dev/sgl/a/{soundfile,cffi,pycparser}-*.whl "$C/sga/audio/"
cp -r "$C/proj" "$C/sg/"
du -sh "$C"/full/s* "$C"/sg*
