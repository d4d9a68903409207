#!/usr/bin/env bash
# The GPU checks of the SeerAttention-R kernels, in one run of under eight minutes on one H100:
# the GPU-only tests (compiled Triton and TileLang decode kernels against the PyTorch reference
# in fp16/bf16, the paged decode step on vLLM's cache layout through the compiled Triton kernel,
# captured in a CUDA graph, the fused pooling kernel, sparse generation through transformers on
# the GPU) and benchmarks/sparse_decode.py --quick (decode time against dense SDPA /
# FlashAttention at 8k and 32k context, batch 1, 8 and 32, 50/75/90% sparsity).
#
# For the device machine of docs/benchmarks.md: torch, Triton and transformers are installed
# there, vLLM and the network are not. TileLang comes as a carried wheel: put
# tilelang-0.1.12-*.whl (the version the gpu extra pins, 50 MB) under .gpu-wheels/ and carry that
# folder; it is installed with --no-deps into .gpu-site/ (nothing of the machine's own Python is
# changed). Results (logs, JSON) go to $OUT, or to ./gpu-checks-out.
#
#     bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-checks-out}"
mkdir -p "$out"
exec > >(tee "$out/gpu_checks.log") 2>&1
start=$(date +%s)
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }
status=0

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || status=1
python - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "tilelang", "pytest", "packaging", "flash_attn"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # what is missing is reported, not fatal
        print(name, "missing:", type(exc).__name__, exc)
EOF

step "carried wheels"
export PYTHONPATH="$PWD/.gpu-site:$PWD/kernels:$PWD/sandbox:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  python -m pip install --no-deps --no-index --target .gpu-site .gpu-wheels/*.whl -q \
    && echo "installed into .gpu-site: $(ls .gpu-wheels)" || status=1
  python -c "import tilelang; print('tilelang', tilelang.__version__)" \
    || echo "tilelang does not import (a dependency missing here?): its kernel is skipped"
else
  echo "no .gpu-wheels/*.whl carried: TileLang is checked only if the machine has it"
fi

step "GPU tests"
# All kernel tests (those marked for a GPU run only there), then the transformers test of
# sparse generation on the GPU.
if python -c "import pytest" 2>/dev/null; then
  timeout 200 python -m pytest -p no:cacheprovider -q -rs tests/kernels \
    --junitxml="$out/kernels.xml" || status=1
  if python -c "import pydantic, httpx" 2>/dev/null; then
    timeout 80 python -m pytest -p no:cacheprovider -q -rs \
      tests/llm/test_llm_sparse_decoding.py -k "gpu" --junitxml="$out/transformers.xml" \
      || status=1
  else
    echo "pydantic/httpx missing: sparse generation through TransformersLLM not run"
    status=1
  fi
else
  echo "pytest missing: the GPU tests were not run"
  status=1
fi

step "sparse decode benchmark"
timeout 180 python benchmarks/sparse_decode.py --quick --out "$out/sparse_decode.json" \
  | tee "$out/sparse_decode.md" || status=1

step "done: exit $status"
exit $status
