#!/usr/bin/env bash
# Run HERE (a machine with a registry): lay out the carries for the GPU machine under .dev/carry/.
#   s0..s3: Transformer Engine's core wheel, parts 0-3 (fetch_te_core.sh output, 60 MiB each)
#   s4:     core part 4 + TE's Python wheels + megatron-core 0.19.2 + SGLang set b (flashinfer) + the project
#   s5:     SGLang set a (sglang 0.5.17, sglang-kernel, transformers 5.12.1, ...) + this project as a wheel
#   sgk:    sglang-kernel alone (stage.sh .dev/carry/sgk first: sg with it and the tracked tree pass 64 MiB)
#   sg:     SGLang sets a (without sglang-kernel, and without soundfile and its cffi: audio only, imported
#           lazily) and b + the project: with sgk staged, the SGLang-only stack (QUADS_STACK=sglang); after
#           it, s0..s3 staged + s4 installed add TE to that stack (install.sh .dev/carry/s4)
#   sga:    the three audio wheels sg leaves out (soundfile, cffi, pycparser): `sglang.launch_server` imports
#           soundfile at start, the Engine does not; install.sh .dev/carry/sga adds them to an sg stack
# Inputs: .dev/te/p0..p4 (../shared/device/fetch_te_core.sh .dev/te), .dev/sgl/{a,b}
# (../shared/device/build_sglang_wheels.sh .dev/sgl), the TE wheel folder (TE_WHEELS, default ../shared/device/te-2.20.2).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
TE_WHEELS=${TE_WHEELS:-../shared/device/te-2.20.2}
C=.dev/carry
rm -rf "$C" && mkdir -p "$C"/s{0,1,2,3,4,5}
for k in 0 1 2 3; do ln .dev/te/p$k/te_core.part$k "$C/s$k/"; done
ln .dev/te/p4/te_core.part4 "$C/s4/"
mkdir -p "$C/s4/te" "$C/s4/b"
cp "$TE_WHEELS"/transformer_engine-*.whl "$TE_WHEELS"/transformer_engine_torch-*.whl "$TE_WHEELS"/megatron_core-*.whl \
   "$TE_WHEELS"/typing_extensions-*.whl "$C/s4/te/"
cp .dev/sgl/b/*.whl "$C/s4/b/"
mkdir -p "$C/s5/a" "$C/s5/proj"
cp -r .dev/sgl/a/. "$C/s5/a/"
python3 -m pip wheel -q --no-deps -w "$C/s5/proj" . 2>&1 | grep -v "^WARNING: Location" || true
mkdir -p "$C/sg/a" "$C/sg/b" "$C/s4/proj"
cp -r .dev/sgl/a/. "$C/sg/a/" && rm -f "$C"/sg/a/{soundfile,cffi,pycparser}-*.whl
mkdir -p "$C/sgk/a" && mv "$C"/sg/a/sglang_kernel-*.whl "$C/sgk/a/"
cp .dev/sgl/b/*.whl "$C/sg/b/"
mkdir -p "$C/sga/audio" && cp .dev/sgl/a/{soundfile,cffi,pycparser}-*.whl "$C/sga/audio/"
cp -r "$C/s5/proj" "$C/sg/" && cp "$C"/s5/proj/*.whl "$C/s4/proj/"
du -sh "$C"/s*
echo "each carry + the working tree must stay under 64 MiB: $(git ls-files -z | du -ch --files0-from=- | tail -1)"
