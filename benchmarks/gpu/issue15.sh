#!/usr/bin/env bash
# Issue 15's GPU measurements in one device call: `pytest -m gpu`, then the throughput rows (eager floor; compiled
# floor, lowrank, lora, a single member's generate and full mode), then configs/es_conciseness.yaml end to end.
# Steps run in order of priority, each under its own time limit; everything lands in $OUT.
#
#   device run (carry .whl .gpu):  bash benchmarks/gpu/issue15.sh [steps]   steps: next, then, or profile,tests,kernel,inside,inside_mlp,tiles,bench1,bench2,sbs,deepspeed,fused,host,prefill,determinism,memory,e2e
# E2E_ARGS adds esrl fit flags to e2e (e.g. "--model.rollout.compile fused"); DET_COMPILE=on limits determinism to the
# recorded path (the default on CUDA); BENCH2_MODES overrides bench2's modes (e.g. single,full).
# sbs: the same rows side by side in ONE process (es_throughput.py --rounds), so their ratios share the machine's state.
# It prints the summary after every round and drops a mode that fails (not the first), so a time limit or a new
# variant's error leaves the other ratios.
# tiles: benchmarks/gpu/lowrank_tiles.py (the member-term kernel's block sizes, per 1.5B projection, rank 1 and 8).
# kernel: the same, launch_plan's blocks only, side by side: lora's rank-8 factors in bf16 (its buffers) or fp32, q, k
# and v's terms (gate and up's) in one launch or one each (`one_over_each`, `ms_saved_per_step`), the torch ops against the kernel
# at decode and prefill (`torch_over_kernel`; above KERNEL_ROWS rows a member, ranks over 1 take the torch ops).
# KERNEL_ARGS overrides its ranks and factor dtypes.
# inside: benchmarks/gpu/inside_gemm.py (the member terms inside each projection's GEMM, [x | C] @ [W | A_all^T]^T,
# against the GEMM then the kernel, per projection and over a step, ranks 1 and 8).
# SBS_ARGS adds es_throughput.py flags to sbs (e.g. "--rank 2"); SBS_MODES overrides its modes.
# TILES_S, SBS_S and TESTS_S override the tiles, sbs and tests steps' time limits (seconds).
# host: benchmarks/es_host_work.py (a chunk's load and the update, with and without reusing the load's draws).
# memory: benchmarks/memory_over_steps.py on CUDA (RSS and allocated memory after each of 300 steps: no growth).
# prefill: benchmarks/prefill_head.py (a frozen lm_head on the prompts' last positions, by slice or by index).
# determinism: floor and lowrank, recorded and eager, with esrl's repeatable attention and with any kernel.
# fused: floor, lowrank and lora with rollout.compile: fused (the step torch.compile'd, then recorded) beside the
# recorded-only path, in one call each so their ratios are side by side; FUSED_COMPILES picks among "on fused" (each up
# to ~3 minutes).
# next: what the next device session runs first within its 15 minutes (about 9-10 with the machine's start), the
# pricing first: inside (inside_gemm.py, ~1 minute), then floor, lowrank, lora, lora-overlap and lowrank-overlap (a
# decode step's terms on a side stream beside the GEMMs, esrl.es.side_terms, session 31) and lora-inside (the MLPs'
# terms inside their GEMMs, esrl.es.inside_terms, session 29), both off by default until this prices them, side by
# side (~4 minutes), then the GPU tests (~4-5 minutes; those never run on a GPU first, TESTS_FIRST, then the rest
# in what is left). inside_mlp, lora-apart (gate/up's own launches) and `kernel` at
# rank 8 (gate and up in one launch against one each) were dropped from it for time: `issue15.sh inside_mlp,kernel`.
# then: the second call, at once on the warm machine: lora's recorded step profiled beside the floor's (and with its
# terms beside the GEMMs: busy_over_wall), and deepspeed.
# PROFILE_ARGS: decode_profile.py's flags (PROFILE_S its limit, 200 s). deepspeed: benchmarks/gpu/issue16.sh
# (tests/test_gpu_deepspeed.py, GRPO under ZeRO 1 and 2; session 26's assertions not run yet) in what is left of
# BUDGET_S (585), or DEEPSPEED_S seconds. A 15-minute session: `next` with SBS_S=200 TESTS_S=240 (~8.5 minutes), then
# `then` at once with BUDGET_S = status's budget_left_s - 30 (profile only if that is under ~5 minutes).
# .whl holds the wheels the GPU image lacks (jsonargparse, docstring-parser, typeshed-client); .gpu/tok the
# embedded model's config and tokenizer files (no weights).
set -uo pipefail
STEPS=${1:-profile,tests,bench1,bench2,e2e}
NEXT=""; [ "$STEPS" = next ] && { NEXT=1; STEPS=tests; SBS_MODES=${SBS_MODES:-floor,lowrank,lora,lora-overlap,lowrank-overlap,lora-inside}; }
[ "$STEPS" = then ] && { STEPS=profile,deepspeed; PROFILE_ARGS=${PROFILE_ARGS:---modes floor,lora,lora-overlap}; }
# BUDGET_S: the seconds this call may take (status's budget_left_s less a margin); steps after it are skipped or cut
BUDGET_S=${BUDGET_S:-585}
OUT=${OUT:-/tmp/esrl_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export ESRL_TOKENIZER=$PWD/.gpu/tok
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, transformers, lightning; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/device.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
quiet() { grep --line-buffered -v -E "Warning: |warn_once\(|warnings\.warn\("; }  # Python's warnings; line by line (a kill
# of the call keeps what was written)
BENCH="--model random:qwen2.5-1.5b --device cuda --prompts 8 --new-tokens 256 --members 30 --tokenizer $PWD/.gpu/tok"

fused() {  # recorded only, then torch.compile'd and recorded, each in one process (~3 minutes each)
  for c in ${FUSED_COMPILES:-on fused}; do
    (cd benchmarks && timeout 280 python3 es_throughput.py $BENCH --modes floor,lowrank,lora --compile $c --repeats 2 2>&1 | tee "$OUT/bench_$c.log" | grep '^{')
  done
}
kernel() {  # launch_plan's blocks and the torch ops side by side, per projection
  timeout ${KERNEL_S:-240} python3 benchmarks/gpu/lowrank_tiles.py ${KERNEL_ARGS:---ranks 1,8 --factor-dtypes bfloat16,float32} \
    --default-only 2>&1 | quiet | tee "$OUT/lowrank_kernel.jsonl" | grep -E '"best"|"linears"|Error'
}
inside() {  # the member terms inside the projection's GEMM, priced per projection before anyone builds it
  timeout -k 5 ${INSIDE_S:-120} python3 benchmarks/gpu/inside_gemm.py --ranks 8,1 2>&1 | quiet | tee "$OUT/inside_gemm.jsonl" | grep -E 'per_step|Error'
}
inside_mlp() {  # the inside path's own module against the kernel's, per MLP layer (its layout, copies and strided reads)
  timeout ${INSIDE_MLP_S:-60} python3 benchmarks/gpu/inside_mlp.py 2>&1 | quiet | tee "$OUT/inside_mlp.jsonl" | grep -E 'rank|Error'
}
sbs() {  # the ratios side by side in one process, 3 rounds
  (cd benchmarks && timeout ${SBS_S:-400} python3 es_throughput.py $BENCH --modes ${SBS_MODES:-floor,lowrank,lora,single} --compile on --rounds 3 ${SBS_ARGS:-} 2>&1 | tee "$OUT/bench_sbs${1:-}.log" | grep '^{')
}
if [ -n "$NEXT" ]; then  # the pricing first (inside, the ratios side by side, gate/up's one launch), then the tests
  INSIDE_S=45 inside; SBS_S=${SBS_S:-240} sbs
  TESTS_S=${TESTS_S:-280}  # at most ~575 s in all, within a call's 600
  TESTS_FIRST=${TESTS_FIRST-"own_member_count or exports or side_stream or another_terms_path or shared_launches or terms_inside or one_launch or overlap or refused_on_the_cpu"}  # fused fits (a compile each) after
fi
if has profile; then
  profile_s=${PROFILE_S:-200}; [ $(( BUDGET_S - SECONDS - 20 )) -lt "$profile_s" ] && profile_s=$(( BUDGET_S - SECONDS - 20 ))
  if [ "$profile_s" -ge 10 ]; then  # (timeout 0 would mean no limit)
    timeout -k 5 $profile_s python3 benchmarks/gpu/decode_profile.py ${PROFILE_ARGS:-} 2>&1 | quiet | tee "$OUT/decode_profile.log"
  else echo "profile: skipped, ${profile_s} s left"; fi
fi
gpu_tests() {  # $1: seconds, $2: a -k expression (empty: all), $3: the log's suffix
  timeout -k 5 $1 python3 -m pytest -v -m gpu tests/test_gpu_kernels.py tests/test_gpu.py -p no:cacheprovider --durations=8 ${2:+-k "$2"} 2>&1 | quiet | tee "$OUT/gpu_tests$3.log" | tail -15
}
if has tests; then  # TESTS_FIRST: a -k expression run first (tests never run on a GPU), the rest after
  if [ -n "${TESTS_FIRST:-}" ]; then
    gpu_tests $(( ${TESTS_S:-420} * 11 / 20 )) "$TESTS_FIRST" _first
    gpu_tests $(( ${TESTS_S:-420} * 9 / 20 )) "not ($TESTS_FIRST)" _rest
  else
    gpu_tests ${TESTS_S:-420} "" ""
  fi
fi
has kernel && kernel
has inside && inside
has inside_mlp && inside_mlp
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
if has deepspeed; then  # GRPO's GPU tests under ZeRO: issue16.sh (DeepSpeed installed from .whl/sdist, ~10-30 s)
  left=$(( ${DEEPSPEED_S:-BUDGET_S - SECONDS} ))
  if [ "$left" -gt 90 ]; then TEST_TIMEOUT=$(( left - 60 )) timeout -k 5 $left bash benchmarks/gpu/issue16.sh
  else echo "deepspeed: skipped, ${left} s left"; fi
fi
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
    rm -rf /tmp/e2e_$mode  # a second e2e on a warm machine: its own metrics.csv, not version_0's
    timeout 200 python3 $prof -m esrl.cli fit --config configs/es_conciseness.yaml --model.policy.name_or_path /tmp/qwen15b \
      --model.es.mode $mode --trainer.max_steps $steps --trainer.default_root_dir /tmp/e2e_$mode \
      --trainer.enable_progress_bar false ${E2E_ARGS:-} 2>&1 | quiet | tail -6
    f=$(ls /tmp/e2e_$mode/lightning_logs/version_*/metrics.csv 2>/dev/null | head -1)
    [ -n "$f" ] && cp "$f" "$OUT/e2e_${mode}_metrics.csv"
    [ -n "$prof" ] && python3 -c "import pstats; pstats.Stats('$OUT/e2e_$mode.prof').sort_stats('tottime').print_stats(25)" | tail -40
  done
fi
ls -la "$OUT"
