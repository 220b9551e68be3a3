#!/usr/bin/env bash
# Issue 15's GPU measurements in one device call: `pytest -m gpu`, then the throughput rows (eager floor; compiled
# floor, lowrank, lora, a single member's generate and full mode), then configs/es_conciseness.yaml end to end.
# Steps run in order of priority, each under its own time limit; everything lands in $OUT.
#
#   device run (carry .whl .gpu):  bash benchmarks/gpu/issue15.sh [steps]   steps: next or profile,tests,kernel,inside,tiles,bench1,bench2,sbs,fused,host,prefill,determinism,memory,e2e
# E2E_ARGS adds esrl fit flags to e2e (e.g. "--model.rollout.compile fused"); DET_COMPILE=on limits determinism to the
# recorded path (the default on CUDA); BENCH2_MODES overrides bench2's modes (e.g. single,full).
# sbs: the same rows side by side in ONE process (es_throughput.py --rounds), so their ratios share the machine's state.
# tiles: benchmarks/gpu/lowrank_tiles.py (the member-term kernel's block sizes, per 1.5B projection, rank 1 and 8).
# kernel: the same, launch_plan's blocks only, side by side: lora's rank-8 factors in bf16 (its buffers) or fp32, q, k
# and v's terms in one launch or three (`one_over_three`, `ms_saved_per_step`), and the torch ops against the kernel
# at decode and prefill (`torch_over_kernel`; above KERNEL_ROWS rows a member, ranks over 1 take the torch ops), and the
# block-diagonal GEMM (`gemm_over_kernel`, per projection in best_per_shape: what GEMM_OUTS should be). KERNEL_ARGS
# overrides its ranks and factor dtypes.
# inside: benchmarks/gpu/inside_gemm.py (the member terms inside each projection's GEMM, [x | C] @ [W | A_all^T]^T,
# against the GEMM then the kernel, per projection and over a step, ranks 1 and 8).
# SBS_ARGS adds es_throughput.py flags to sbs (e.g. "--gemm-outs 8960").
# TILES_S, SBS_S and TESTS_S override the tiles, sbs and tests steps' time limits (seconds).
# host: benchmarks/es_host_work.py (a chunk's load and the update, with and without reusing the load's draws).
# memory: benchmarks/memory_over_steps.py on CUDA (RSS and allocated memory after each of 300 steps: no growth).
# prefill: benchmarks/prefill_head.py (a frozen lm_head on the prompts' last positions, by slice or by index).
# determinism: floor and lowrank, recorded and eager, with esrl's repeatable attention and with any kernel.
# fused: floor, lowrank and lora with rollout.compile: fused (the step torch.compile'd, then recorded) beside the
# recorded-only path, in one call each so their ratios are side by side; the fused step once with esrl's kernel for the
# member terms and once with products and sums Inductor fuses (es_throughput.py --compiled-terms); FUSED_VARIANTS
# picks among on:kernel,fused:kernel,fused:torch (each up to ~3 minutes).
# next: what the next device session runs first within its 15 minutes (about 10 with the machine's start): the kernel
# step at rank 8 (the GEMM against the kernel, ~1 minute), sbs (with lora_gemm beside lora where the GEMM won), the
# fused step with Inductor's terms (issue 15's open levers for lora), then the GPU tests in what is left.
# .whl holds the wheels the GPU image lacks (jsonargparse, docstring-parser, typeshed-client); .gpu/tok the
# embedded model's config and tokenizer files (no weights).
set -uo pipefail
STEPS=${1:-profile,tests,bench1,bench2,e2e}
NEXT=""; [ "$STEPS" = next ] && { NEXT=1; STEPS=tests; FUSED_VARIANTS=${FUSED_VARIANTS:-fused:torch}; }
OUT=${OUT:-/tmp/esrl_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export ESRL_TOKENIZER=$PWD/.gpu/tok
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, lightning; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/device.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
quiet() { grep -v -E "Warning: |warn_once\(|warnings\.warn\("; }  # Python's warning lines, not pytest's summary
BENCH="--model random:qwen2.5-1.5b --device cuda --prompts 8 --new-tokens 256 --members 30 --tokenizer $PWD/.gpu/tok"

FUSED_VARIANTS=${FUSED_VARIANTS:-on:kernel,fused:kernel,fused:torch}
fused() {  # recorded only; torch.compile'd with the Triton kernel; torch.compile'd with terms Inductor fuses
  for v in ${FUSED_VARIANTS//,/ }; do
    (cd benchmarks && timeout 280 python3 es_throughput.py $BENCH --modes floor,lowrank,lora --compile ${v%:*} --compiled-terms ${v#*:} --repeats 2 2>&1 | tee "$OUT/bench_${v/:/_}.log" | grep '^{')
  done
}
kernel() {  # launch_plan's blocks, the torch ops and the block-diagonal GEMM side by side, per projection
  timeout ${KERNEL_S:-240} python3 benchmarks/gpu/lowrank_tiles.py ${KERNEL_ARGS:---ranks 1,8 --factor-dtypes bfloat16,float32} \
    --default-only 2>&1 | quiet | tee "$OUT/lowrank_kernel.jsonl" | grep -E '"best"|"qkv"|Error'
}
inside() {  # the member terms inside the projection's GEMM, priced per projection before anyone builds it
  timeout ${INSIDE_S:-120} python3 benchmarks/gpu/inside_gemm.py 2>&1 | quiet | tee "$OUT/inside_gemm.jsonl" | grep -E 'per_step|Error'
}
gemm_outs() {  # the narrowest output width from which the GEMM beat the kernel at decode for every wider projection
  python3 - "$OUT/lowrank_kernel.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"rank"')]
us = {r["tiles"]: r["us_per_call"] for r in rows if r["phase"] == "decode" and r["correct"] is True}
widths = {"q": 1536, "k": 256, "v": 256, "o": 1536, "gate": 8960, "up": 8960, "down": 1536}
if "kernel" in us and "gemm" in us:
    wins = [w for w in sorted(set(widths.values()))
            if all(us["gemm"][n] < 0.97 * us["kernel"][n] for n, v in widths.items() if v >= w)]
    print(wins[0] if wins else "")
PY
}
sbs() {  # the ratios side by side in one process, 3 rounds
  (cd benchmarks && timeout ${SBS_S:-400} python3 es_throughput.py $BENCH --modes ${SBS_MODES:-floor,lowrank,lora,single} --compile on --rounds 3 ${SBS_ARGS:-} 2>&1 | tee "$OUT/bench_sbs${1:-}.log" | grep '^{')
}
# first: the measurements the session is for: the GEMM against the kernel at rank 8 (lora's decode terms), then, if it
# won for some widths, lora with it beside lora with the kernel in one process; Inductor's fused terms; the tests in
# what is left of a 600 s call
if [ -n "$NEXT" ]; then
  KERNEL_ARGS="--ranks 8 --factor-dtypes bfloat16" KERNEL_S=90 kernel
  G=$(gemm_outs); echo "GEMM_OUTS pick: ${G:-none}" | tee "$OUT/gemm_pick.txt"
  if [ -n "$G" ]; then SBS_S=200 SBS_MODES=floor,lowrank,lora,lora_gemm SBS_ARGS="--gemm-outs $G" sbs
  else SBS_S=150 SBS_MODES=floor,lowrank,lora sbs; fi
  fused
  TESTS_S=$(( 585 - SECONDS > 30 ? 585 - SECONDS : 30 ))
fi
if has profile; then
  timeout 150 python3 benchmarks/gpu/decode_profile.py 2>&1 | quiet | tee "$OUT/decode_profile.log"
fi
if has tests; then
  timeout ${TESTS_S:-420} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --durations=8 2>&1 | quiet | tee "$OUT/gpu_tests.log" | tail -15
fi
has kernel && kernel
has inside && inside
if has tiles; then  # block sizes of the member-term kernel: each candidate timed per projection, the best beside the default
  timeout ${TILES_S:-300} python3 benchmarks/gpu/lowrank_tiles.py ${TILES_ARGS:-} 2>&1 | quiet | tee "$OUT/lowrank_tiles.jsonl" | grep -E '"best"|Error'
fi
if has bench1; then
  (cd benchmarks && timeout 60 python3 es_throughput.py $BENCH --modes floor --compile off --repeats 2 2>&1 | grep '^{' | tee "$OUT/bench_eager.jsonl")
  (cd benchmarks && timeout 200 python3 es_throughput.py $BENCH --modes floor,lowrank --compile on --repeats 2 2>&1 | grep '^{' | tee "$OUT/bench_compiled1.jsonl")
fi
if has bench2; then
  (cd benchmarks && timeout 240 python3 es_throughput.py $BENCH --modes ${BENCH2_MODES:-lora,single,full} --compile on --repeats 2 --full-members 3 2>&1 | tee "$OUT/bench_compiled2.log" | grep '^{')
fi
has sbs && sbs
if has host; then  # the iteration's work around its generate: loads and update, factors drawn once or twice
  (cd benchmarks && timeout 150 python3 es_host_work.py --model random:qwen2.5-1.5b --device cuda --rounds 5 2>&1 | tee "$OUT/host_work.log" | grep '^{')
fi
has fused && fused
if has prefill; then  # the frozen head on a strided slice vs a gathered index (what the static decoder passes)
  (cd benchmarks && timeout 120 python3 prefill_head.py --model random:qwen2.5-1.5b --device cuda --rows 240 --tokenizer "$ESRL_TOKENIZER" 2>&1 | tee "$OUT/prefill_head.log" | grep '^{')
fi
if has determinism; then  # its cost: rollouts free to use any SDPA kernel (cuDNN's, not repeatable) vs esrl's choice
  for a in repeatable any; do
    (cd benchmarks && timeout 280 python3 es_throughput.py $BENCH --modes floor,lowrank --compile ${DET_COMPILE:-on,off} --repeats 2 --attention $a 2>&1 | grep '^{' | tee "$OUT/bench_attention_$a.jsonl")
  done
fi
if has memory; then  # a leak shows as growth over the steps: the recorded decode path, lowrank and lora
  timeout 240 python3 benchmarks/memory_over_steps.py --device cuda --runs es:lowrank,es:lora --steps 300 --tokenizer "$ESRL_TOKENIZER" 2>&1 | grep '^{' | tee "$OUT/memory_over_steps.jsonl"
fi
if has e2e; then
  python3 - <<'PY'
import os, torch, sys
sys.path.insert(0, "benchmarks")
from bench_setup import QWEN25_15B
from transformers import Qwen2Config, Qwen2ForCausalLM
from esrl.models import load_tokenizer
out = "/tmp/qwen15b"
if not os.path.exists(out + "/config.json"):
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B, torch_dtype="bfloat16")).to(torch.bfloat16)
    m.save_pretrained(out); load_tokenizer(os.environ["ESRL_TOKENIZER"]).save_pretrained(out)
PY
  for mode in ${E2E_MODES:-lowrank full}; do
    steps=${E2E_STEPS:-3}; [ $mode = full ] && steps=1
    prof=""; [ -n "${E2E_PROFILE:-}" ] && prof="-m cProfile -o $OUT/e2e_$mode.prof"
    timeout 200 python3 $prof -m esrl.cli fit --config configs/es_conciseness.yaml --model.policy.name_or_path /tmp/qwen15b \
      --model.es.mode $mode --trainer.max_steps $steps --trainer.default_root_dir /tmp/e2e_$mode \
      --trainer.enable_progress_bar false ${E2E_ARGS:-} 2>&1 | quiet | tail -6
    f=$(ls /tmp/e2e_$mode/lightning_logs/version_*/metrics.csv 2>/dev/null | head -1)
    [ -n "$f" ] && cp "$f" "$OUT/e2e_${mode}_metrics.csv"
    [ -n "$prof" ] && python3 -c "import pstats; pstats.Stats('$OUT/e2e_$mode.prof').sort_stats('tottime').print_stats(25)" | tail -40
  done
fi
ls -la "$OUT"
