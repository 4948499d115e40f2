#!/usr/bin/env bash
# One GPU session (H100 or H200): zsim's compute against real Hugging Face Llama-3 decoder layers.
# `zsim calibrate --hf-layer` builds one layer of Llama-3-8B and of Llama-3-70B (transformers, random
# weights, nothing downloaded; configs in benchmarks/hf_layer/), times it per module kind in bf16 with
# SDPA at seq 512-4096 and micro-batch 1-4, fits the base profile's compute figures (dgx-h100, or h200-1gpu on an H200; BASE=... to choose) to each, and writes
#   hardware_profiles/<gpu>-hf-llama3-{8b,70b}.yaml and calibration/runs/<gpu>-hf-llama3-{8b,70b}/
# (records.json: raw timings; fit_report.json: residuals per kind before and after the fit).
# Needs torch with CUDA on the machine; installs the hf extra. Estimated 3-6 minutes on one H100
# (the 70B layer at s4096-b4: ~30 TFLOP per forward). Commit the two run directories and profiles.
# Usage: bash benchmarks/gpu_hf_layer.sh [REPS]   (default 10 timed repetitions per unit)
#
# On the lent device machine (../.library/device: no network; its python3 has torch, transformers,
# numpy, pyyaml, rich and matplotlib, not simpy): carry simpy as a wheel. Here, in the repo root:
#   mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl simpy==4.1.1
# then run(command="bash benchmarks/gpu_hf_layer.sh", carry=[".whl"], timeout_s=600). With $OUT set
# (the device tool's folder that comes back) the two runs' records, fit reports and profiles are
# copied there (6 files): commit them under calibration/runs/ and hardware_profiles/.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-10}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python3 -c "import transformers" 2>/dev/null || python3 -m pip install -q -e '.[hf]'
# the zsim command and its calibrate entry point, without fetching anything
command -v zsim >/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
gpu=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
# the profile whose compute figures are refitted (its peak and HBM bandwidth are kept): the H200's own
# calibrated one on an H200 (4.8 TB/s HBM; dgx-h100's 3.35 would cap memory-bound efficiency at 1)
base=${BASE:-$([ "$gpu" = h200 ] && echo h200-1gpu || echo dgx-h100)}
for m in llama3-8b llama3-70b; do
  zsim calibrate --hf-layer --model "benchmarks/hf_layer/$m.json" --seq-len 512,1024,2048,4096 \
    --micro-batch 1,2,4 --dtype bf16 --attn-implementation sdpa --base "$base" --reps "$reps" \
    --out "$gpu-hf-$m" --force
done
if [ -n "${OUT:-}" ]; then
  for m in llama3-8b llama3-70b; do
    for f in records.json fit_report.json; do cp "calibration/runs/$gpu-hf-$m/$f" "$OUT/$gpu-hf-$m.$f"; done
    cp "hardware_profiles/$gpu-hf-$m.yaml" "$OUT/"
  done
fi
