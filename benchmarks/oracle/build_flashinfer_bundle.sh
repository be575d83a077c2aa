#!/usr/bin/env bash
# Build the FlashInfer bundle that vLLM 0.26.0's default GDN prefill backend needs on an SM90 GPU (issue 17), for
# the offline H200 (Python 3.12, torch 2.11.0+cu130, no network), as ONE xz tarball split into pieces of at most
# CHUNK bytes, like shared/tools/vllm-oracle/build_bundle.sh. Runs on a machine with the package registry.
#
# What vLLM 0.26.0 needs (benchmarks/oracle/flashinfer.md has the reading of the sources):
#   flashinfer-python==0.6.14   pinned by vllm-0.26.0's METADATA; on SM90 its chunk_gated_delta_rule runs a
#                               CuTe-DSL kernel (gdn_kernels/delta_rule_dsl/delta_rule_sm90.py) compiled in process
#   nvidia-cutlass-dsl==4.6.0   the CuTe DSL (vLLM pins nvidia-cutlass-dsl[cu13]==4.6.0) with libs-base, libs-core
#                               and the cu13 flavour (the cu12 flavour is left out: the loader picks cu13 on a CUDA 13
#                               driver when it is the only one present)
#   cuda-bindings, cuda-pathfinder, nvidia-cuda-nvdisasm, protobuf: the DSL's own requirements
#   nvidia-ml-py, requests (+ urllib3, idna, certifi, charset-normalizer), einops, click, tabulate, cuda-tile:
#                               imported by flashinfer's modules
#   quack-kernels==0.6.0        vLLM's CuTe-DSL low-latency router GEMM (kernel_warmup._warmup_ll_bf16_router_gemm,
#                               enabled once cutlass imports) imports quack.compile_utils: without it the engine core
#                               fails at start-up (seen on the H200, 2026-12-04). vLLM asks quack-kernels>=0.4.0;
#                               0.6.0 is the newest that accepts vLLM's nvidia-cutlass-dsl==4.6.0 pin (0.6.5 asks
#                               >=4.7). torch-c-dlpack-ext is its own requirement.
# apache-tvm-ffi==0.1.10 is already in the vLLM bundle. flashinfer-cubin 0.6.14 and flashinfer-jit-cache are not
# on PyPI; neither is needed for the CuTe-DSL GDN kernel (their cubins/.so serve the C++ JIT kernels).
#
# usage: build_flashinfer_bundle.sh [OUTDIR]   (env CHUNK=34M)
set -euo pipefail
OUTDIR=${1:-./flashinfer_bundle}
CHUNK=${CHUNK:-34M}  # a piece plus the ~28 MB working tree must stay under a call's 64 MiB
PY=${PY:-python3}
W=$OUTDIR/wheels
S=$OUTDIR/stage
rm -rf "$S" "$OUTDIR"/part.* "$OUTDIR"/flashinfer_bundle.tar.xz
mkdir -p "$W" "$S"

PLAT=""
for n in 5 17 24 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
TGT="--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none $PLAT"

# cuda-bindings 13.0.x: the H200's torch is a CUDA 13.0 build; a newer minor would also load, but 13.0 is the
# lowest the driver must support.
PKGS="flashinfer-python==0.6.14 nvidia-cutlass-dsl==4.6.0 nvidia-cutlass-dsl-libs-base==4.6.0
nvidia-cutlass-dsl-libs-core==4.6.0 nvidia-cutlass-dsl-libs-cu13==4.6.0 cuda-bindings==13.0.3 cuda-pathfinder==1.9.1
nvidia-cuda-nvdisasm==13.5.37 protobuf==6.33.6 nvidia-ml-py==13.615.71 requests==2.32.5 urllib3==2.5.0 idna==3.10
certifi==2025.8.3 charset-normalizer==3.4.3 einops==0.8.1 click==8.5.1 tabulate==0.10.0 cuda-tile==1.7.0
quack-kernels==0.6.0 torch-c-dlpack-ext==0.1.5"

"$PY" -m pip download -q --no-deps --only-binary=:all: $TGT -d "$W" $PKGS
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$S" $TGT "$W"/*.whl
rm -rf "$S"/bin
find "$S" -name __pycache__ -type d -prune -exec rm -rf {} +
# .pth files are not read from a PYTHONPATH folder: list them, the registry's site puts their paths on PYTHONPATH.
find "$S" -maxdepth 1 -name '*.pth' -print -exec cat {} \; -exec echo \;
du -sh "$S"

tar -cf - -C "$S" . | xz -6 -T0 > "$OUTDIR"/flashinfer_bundle.tar.xz
(cd "$OUTDIR" && split -b "$CHUNK" -d -a 2 flashinfer_bundle.tar.xz part. \
   && sha256sum flashinfer_bundle.tar.xz > flashinfer_bundle.sha256 && ls part.* | wc -l > parts.count \
   && ls -l part.* flashinfer_bundle.tar.xz && echo "pieces: $(cat parts.count)" && cat flashinfer_bundle.sha256)
# Put piece k with a copy of parts.count into a git-ignored folder .fi_chunk<k> of the checkout (.fi_chunk,
# .fi_chunk2, ...) and send them in consecutive device calls (`bash scripts/h200.sh setup` stores and unpacks them).
