#!/usr/bin/env bash
# Issue 16's GPU checks in one device call: GRPO under DeepSpeed (Lightning runs DeepSpeed on CUDA only), i.e.
# tests/test_gpu_deepspeed.py: accumulation exactness under ZeRO-2 (dapo, vespo) and GRPO LoRA under ZeRO-1/2
# (equal to one GPU, final/adapter + merged, resume). Logs land in $OUT.
#
#   device run (carry .whl .gpu):  bash benchmarks/gpu/issue16.sh
# .whl holds the wheels the GPU image lacks (jsonargparse, docstring-parser, typeshed-client, hjson, pydantic,
# pydantic-core, annotated-types, typing-inspection) and .whl/sdist DeepSpeed's source (installed without its ops,
# which GRPO does not use); .gpu/tok the embedded model's config and tokenizer files (no weights).
set -uo pipefail
OUT=${OUT:-/tmp/esrl_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export ESRL_TOKENIZER=$PWD/.gpu/tok
DS_BUILD_OPS=0 timeout 300 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  --target /tmp/site .whl/sdist/deepspeed-*.tar.gz 2>&1 | tail -5 | tee "$OUT/deepspeed_install.log"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "deepspeed: install failed (the tests would only skip)"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/device.txt"
python3 -c "import torch, transformers, lightning, deepspeed, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__, 'peft', peft.__version__)" | tee -a "$OUT/device.txt"
timeout -k 5 ${TEST_TIMEOUT:-420} python3 -m pytest -v -m gpu tests/test_gpu_deepspeed.py -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
  | grep --line-buffered -v -i warn | tee "$OUT/deepspeed_tests.log" | tail -30
rc=${PIPESTATUS[0]}
ls -la "$OUT"
exit "$rc"
