#!/usr/bin/env bash
# Run HERE (the CPU machine, which reaches the package index) before shipping the checkout to the GPU
# machine (which does not): downloads into .kit-extra/ (git-ignored, carried along like .kit/) the
# pure-Python wheels the frontier-family GPU parts need beyond the device image and .kit/:
#   fla-core 0.6.0 (flash-linear-attention's kernels: the `fla` package megatron-core's gated delta
#     net imports -- chunk_gated_delta_rule, causal_conv1d, l2norm; Triton, so pure Python) and
#     einops (its one dependency). Part oracle_gdn then also compares Megatron with fla's kernels.
# transformers is NOT shipped: 5.17 (the device's) has every frontier model type (qwen3_next,
# qwen3_5_text, qwen3_5_moe_text, deepseek_v32, glm_moe_dsa). fast_hadamard_transform (a CUDA
# extension) is not shipped either: part oracle_dsa uses the pure-torch stand-in in tests/gpu/standins.
# .ci/gpu installs .kit-extra/*.whl into .kit/site (pip --no-index --no-deps --target) when the folder
# exists; without it the fla comparison is reported as a skip. Total ~1.2 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .kit-extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  --platform any -d .kit-extra fla-core==0.6.0 einops==0.8.2
ls -la .kit-extra
du -sh .kit-extra
