#!/usr/bin/env bash
# The GPU session's one prepared check (issue 19, item 5; docs/design/0038): the Triton kernels'
# parity tests compiled on the GPU, every CUDA-marked test under both backends, the W2-GPU / W1-GPU
# figures and the demo on CUDA. Run from the repository root on a machine with a CUDA GPU, torch
# and Triton installed (no network needed: dynemb runs from src/). Logs and figures go to $OUT
# (default ./device-out). About 6 minutes on an H100.
#
#     bash benchmarks/device_check.sh            # everything
#     QUICK=1 bash benchmarks/device_check.sh    # tests only
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() { echo "== $* ($(date -u +%T))"; }

step "machine"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
git rev-parse --short HEAD 2>/dev/null || true

PYTEST=(python3 -m pytest -q -o addopts= -p no:cacheprovider --timeout=300)
python3 -c "import pytest_timeout" 2>/dev/null || PYTEST=(python3 -m pytest -q -o addopts= -p no:cacheprovider)
# The CUDA-marked tests live in these files (the TorchRec ones need torchrec, absent there).
CUDA_FILES=$(grep -l cuda tests/nn/*.py tests/storage/*.py tests/table/*.py tests/kernels/test_backend.py tests/test_import.py)

step "Triton parity, compiled"
"${PYTEST[@]}" tests/kernels/test_triton_parity.py 2>&1 | tee "$OUT/parity.log" || status=1
for backend in auto torch; do
    step "CUDA-marked tests, backend $backend"
    DYNEMB_BACKEND=$backend "${PYTEST[@]}" -m cuda $CUDA_FILES 2>&1 | tee "$OUT/cuda-$backend.log" || status=1
done

if [ -z "${QUICK:-}" ]; then
    step "W2-GPU / W1-GPU"
    (cd benchmarks && python3 gpu.py --repeats 3 --steps 8 --out "$OUT/gpu.jsonl") 2>&1 | tee "$OUT/gpu.log" || status=1
    step "demo on CUDA"
    python3 -m dynemb.demo --device cuda 2>&1 | tail -5 | tee "$OUT/demo.log" || status=1
fi
step "done, status $status"
exit $status
