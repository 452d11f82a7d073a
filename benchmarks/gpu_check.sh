#!/usr/bin/env bash
# Every GPU check, in sections, on a machine with one NVIDIA GPU and no network:
#
#   setup          1 env: nvidia-smi; python, torch, CUDA, library versions; what imports; torch attention features
#                  2 install: missing or older HF libraries from benchmarks/wheels (fetch_gpu_wheels.sh), into a temp dir
#   step           the training step (STEP_BUDGET s, 480 by default)
#                  kernels: gpu_checks.py kernels, the Triton RMSNorm (and rotated q/k norm), rotary and SiLU-gated
#                    kernels against the op sequences they replace at the Qwen3-0.6B shape (fp32, bf16), each way's time
#                    and the bandwidth the kernel's fewest bytes imply; the norm kernels timed at 4-32 warps (TIME lines)
#                  bench-ac: bench_sft.py, Qwen3-0.6B shape, seq 2048, activation checkpointing on (TRL's default): TRL
#                    vs hfnative eager, with torch_compile=True, without the Triton kernels and with full checkpointing
#                    (gradient_checkpointing_kwargs={"selective": False}: the memory trade); one warm-up step of
#                    each profiled, its top kernels to <results>-profiles/sft-ac/<runner>-top-kernels.txt
#                  bench: the same without activation checkpointing, transformers' Trainer beside TRL, and hfnative
#                    with the CPU's device policy forced too (the GPU policy's trades, measured); profiles in .../sft/
#   headline       one figure for each GPU bar, for a session whose device time fits one call (HEADLINE_BUDGET s, 520
#                  by default; not run unless named; then run the full sections as time allows)
#                  head-ac: bench_sft.py --activation_checkpointing, TRL vs hfnative eager and compiled, Qwen3-0.6B
#                  head-gen: bench_generate.py, transformers' generate vs the native engine at batch 64 x 256 tokens
#                  head-grpo: bench_grpo.py, GRPO seconds per step, hfnative vs TRL (use_vllm=False)
#   step_more      the rest of the training step (STEP_MORE_BUDGET s, 520 by default; not run unless named)
#                  dpo: bench_dpo.py, TRL vs hfnative's DPO at the Qwen3-0.6B shape, profiles in .../dpo/
#                  packed: bench_sft.py --packing, TRL vs hfnative on packed variable-length documents, eager and
#                    compiled (torch_compile=True: varlen_attn inside each block's graph)
#                  lora: bench_sft.py --lora --activation_checkpointing, TRL + peft vs hfnative training LoRA adapters
#                    on every linear layer (r 16) with TRL's default checkpointing
#                  moe-lora: bench_expert_lora.py, TRL + peft vs hfnative on LoRA over the stacked experts
#                    (target_parameters, the gpt-oss recipe) at gpt-oss-20b's layer shape, 2 layers, bf16 autocast
#                  qlora: bench_sft.py --lora --activation_checkpointing, hfnative's LoRA vs QLoRA (NF4 base in
#                    bf16) with its weights made whole by the Triton kernel vs by torchao's op sequence
#   rollout        generation's bars (ROLLOUT_BUDGET s, 420 by default)
#                  bench-gen: bench_generate.py, native engine vs transformers' generate, Qwen3-0.6B shape, bf16,
#                    batch 64 and 8 x 256 new tokens; a decode step's time beside its memory-bandwidth floor
#                  bench-grpo: bench_grpo.py, s/step of hfnative's GRPOTrainer vs TRL's (use_vllm=False), same model,
#                    bf16, 8 generations x 256 tokens
#                  generation: gpu_checks.py generation, the native decode step uncaptured and in a CUDA graph:
#                    the same tokens, log-probs as transformers' forward (tiny models, fp32); unseeded
#                    sampling captured (torch's generator); a MoE
#                    under bf16 autocast captured where its grouped matmuls can be (sm90/sm100); and rollouts
#                    between fused AdamW steps under bf16 autocast (a DoRA policy too) as an eager engine makes them
#   rollout_more   the rest of generation (ROLLOUT_MORE_BUDGET s, 560 by default; not run unless named)
#                  gen-compiled: the compiled and captured decode step at batch 64 beside its bandwidth floor
#                  bench-kd: bench_kd.py --on-policy, on-policy distillation, hfnative vs TRL, 8 x 256 sampled tokens
#                  gen-stopping: bench_generate.py --stopping, rows ending at many lengths (EOS): the native engine
#                    with its finished rows compacted away vs kept vs transformers' generate, batch 64
#                  gen-lora: bench_generate.py --lora, a LoRA policy (r 16, every linear layer) at batch 64: the native
#                    engine folding the adapters (its default on CUDA) and not, vs peft's model in transformers' generate
#   rollout_trainers  the other on-policy trainers' steps against TRL's (ROLLOUT_TRAINERS_BUDGET s, 420 by default;
#                  not run unless named), each generating with its own engine (TRL use_vllm=False), Qwen3-0.6B, bf16
#                  bench-rloo: bench_grpo.py --trainer rloo, s/step of RLOOTrainer, 8 generations x 256 tokens
#                  bench-gkd: bench_kd.py --trainer gkd --on-policy, GKDTrainer with lmbda=1 (the student's samples)
#                  bench-odpo: bench_reward.py --trainer online_dpo --on-policy, OnlineDPOTrainer, 2 x 256 sampled
#                    tokens a prompt
#   checks         correctness (CHECKS_BUDGET s, 400 by default)
#                  trainers: gpu_trainers.py, 4 bf16 steps of each trainer (SFT, DPO, KTO, reward, distillation, GKD,
#                    GRPO, RLOO, SFT with LoRA training two token rows, SFT with LoRA on an 8-bit base, QLoRA) on
#                    the shipped tiny model: finite losses,
#                    parameters moved, perf/ metrics, the saved folder loads
#                  parity-fp32 / parity-bf16: logits vs transformers on CUDA (fp32: max |Δ| <= 1e-5, KL <= 1e-9;
#                    bf16: error vs fp32 at most 2x transformers' own); attention: SDPA backends, a packed batch
#                    through varlen_attn / flex_attention vs the dense mask, hfnative's variable-length path;
#                  compile: gpu_checks.py compile, a compiled block's checkpoint inside its graph keeps the attention
#                    and projections' results on this torch (backward recomputes 3 matmuls a block, not 6); packed
#                    batches compile into one graph a block around varlen_attn (no graph break, no recompile);
#                  generation-compiled: gpu_checks.py generation --compiled, the native decode step compiled and
#                    captured: the uncaptured engine's tokens, transformers' log-probs (its compiles, from a cold
#                    cache, are why it is not in the rollout section's generation check)
#                  distributed: bench_distributed.py, 1 process vs FSDP2, TP2 and PP2 on 2 NCCL ranks (skipped on
#                    one GPU)
#   low_precision  float8 and bigger models (LOW_PRECISION_BUDGET s, 420 by default; not run unless named)
#                  float8: float8 vs bf16 tokens/s at the Qwen3-4B shape (8 of its blocks), compiled both, per-step losses
#                  fit: a Qwen3-4B full fine-tune at seq 2,048, bf16 weights: the largest batch hfnative and TRL fit
#
#   GPU_CHECK_SECTIONS=headline bash benchmarks/gpu_check.sh  # about 7 minutes: where one call is all there is
#   bash benchmarks/gpu_check.sh                          # step, rollout, checks (about 24 minutes at most)
#   GPU_CHECK_SECTIONS=step bash benchmarks/gpu_check.sh  # the sections named, in this order (one a call where a
#                                                         # call may run 10 minutes: step ~9, rollout ~8, checks ~7;
#                                                         # then step_more ~9, rollout_more ~9, rollout_trainers
#                                                         # ~7, low_precision ~8)
#   bash benchmarks/gpu_check.sh --device cpu             # a rehearsal without a GPU: the same steps, CPU-sized
#   GPU_CHECK_SECTIONS=rollout,checks GPU_CHECK_ONLY=bench-gen,trainers bash benchmarks/gpu_check.sh
#                                                         # only the checks named (with install) of the sections named
#   Every bar of one issue in one session of two calls, e.g. generation's (bench-gen, generation, trainers,
#   bench-grpo in the first; bench-rloo, bench-gkd, bench-odpo, bench-kd in the second):
#   GPU_CHECK_SECTIONS=rollout,checks GPU_CHECK_ONLY=env,bench-gen,generation,bench-grpo,trainers bash ...
#   GPU_CHECK_SECTIONS=rollout_more,rollout_trainers GPU_CHECK_ONLY=bench-rloo,bench-gkd,bench-odpo,bench-kd bash ...
#   (on a GPU the wheels install into benchmarks/.gpu_site, which a warm machine keeps: the second call skips them)
#
# Each check has its own timeout, cut to what is left of its section's budget; a failing check never stops the next.
# The full output and a summary table go to benchmarks/gpu_results/<UTC time>.txt, also copied into $OUT when that
# is set. PYTHON picks the interpreter (default: python3 or python, whichever imports torch). hfnative is imported
# from this tree without being installed.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
if [[ ${1:-} == --device ]]; then DEVICE=${2:?--device needs cuda or cpu}; shift 2; fi
[[ $# -eq 0 && ($DEVICE == cuda || $DEVICE == cpu) ]] || { sed -n '2,75p' "$0"; exit 2; }
if [[ -z ${PYTHON:-} ]]; then  # the image's interpreter that has torch
  for candidate in python3 python; do
    if "$candidate" -c "import torch" >/dev/null 2>&1; then PYTHON=$candidate && break; fi
  done
fi
PYTHON=${PYTHON:-python3}
SECTIONS=${GPU_CHECK_SECTIONS:-step,rollout,checks}
ONLY=${GPU_CHECK_ONLY:-}  # where set, only the checks it names run (and install, which the others need)
BUDGET=120 START=$SECONDS  # setup's; each section sets its own (start_section)
RUN_START=$SECONDS

RESULTS_DIR=benchmarks/gpu_results
mkdir -p "$RESULTS_DIR"
RESULT=$RESULTS_DIR/$(date -u +%Y-%m-%dT%H-%M-%SZ)$([[ $DEVICE == cpu ]] && echo -cpu-rehearsal).txt
PROFILES=${RESULT%.txt}-profiles  # one profiled step per runner: <PROFILES>/<benchmark>/<runner>-top-kernels.txt
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

# hfnative without installing it: its package layout (converters/ and trainers/ are hfnative.converters and
# hfnative.trainers, pyproject's package-dir) rebuilt from links; wheels installed by check 2 go to $SITE: on a GPU
# benchmarks/.gpu_site (git ignores it), which a device machine keeps between calls while it stays warm, so a second
# call finds them installed; it is used again only where an install into it finished, from the same wheels
# (GPU_CHECK_SITE names another such folder, on any device)
STAGE=$WORK/stage KEPT_SITE=${GPU_CHECK_SITE:-$([[ $DEVICE == cuda ]] && echo "$ROOT/benchmarks/.gpu_site")}
SITE=${KEPT_SITE:-$WORK/site}
if [[ -n $KEPT_SITE ]]; then  # a folder this script made (.gpu_check-site in it) is emptied unless it is complete
  WHEELS_LIST=$(ls benchmarks/wheels 2>/dev/null | grep '\.whl$' || true)
  if [[ -f $SITE/.gpu_check-site ]] && [[ ! -f $SITE/.installed-from || $(cat "$SITE/.installed-from") != "$WHEELS_LIST" ]]; then
    rm -rf "$SITE"
  elif [[ -d $SITE && ! -f $SITE/.gpu_check-site && -n $(ls -A "$SITE") ]]; then
    echo "GPU_CHECK_SITE=$SITE: a folder this script did not make; name an empty or new one" >&2 && exit 2
  fi
  mkdir -p "$SITE" && touch "$SITE/.gpu_check-site"
fi
mkdir -p "$STAGE/hfnative" "$SITE"
for entry in "$ROOT"/hfnative/*; do ln -s "$entry" "$STAGE/hfnative/"; done
ln -s "$ROOT/converters" "$STAGE/hfnative/converters"
ln -s "$ROOT/trainers" "$STAGE/hfnative/trainers"
export PYTHONPATH="$STAGE:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
# transformers (5.25 here) depends on `kernels` and, on CUDA, resolves hub kernels (kernels-community/rotary, ...) when a
# model is built; with no network that raises, so the peers run with their built-in torch code
export USE_HUB_KERNELS=NO
# a CPU rehearsal compiles into a cache of its own: a check killed at its timeout while the C++ compiler writes a
# kernel's library leaves it cut short in the cache, and every later compile of that kernel fails to load it
# ("file too short"), in this run and the next (on CUDA inductor's Python and Triton's kernels are written whole)
[[ $DEVICE == cpu ]] && export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor

NAMES=() STATUSES=() DURATIONS=() NOTES=()

# run_check NAME TIMEOUT VERDICT COMMAND...: runs COMMAND under its timeout (cut to what is left of the budget),
# appends its output to the results file; VERDICT (a function of the log file) turns a zero exit into
# PASS / FAIL / WARN and a note.
run_check() {
  local name=$1 limit=$2 verdict=$3
  shift 3
  if [[ -n $ONLY && ",$ONLY," != *",$name,"* && $name != install ]]; then return; fi
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 15)); then
    record "$name" SKIP 0 "not started: the section's ${BUDGET} s budget is spent"
    return
  fi
  ((limit > left)) && limit=$left
  local log=$WORK/$name.log begin=$SECONDS rc
  printf '\n=== %s (timeout %s s): %s\n' "$name" "$limit" "$*" >>"$RESULT"
  echo "--- $name (timeout ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  cat "$log" >>"$RESULT"
  local seconds=$((SECONDS - begin)) status note
  if ((rc == 124 || rc == 137)); then
    status=TIMEOUT note="killed after ${limit} s; last line: $(last_line "$log")"
  elif ((rc != 0)); then
    status=FAIL note="exit $rc: $(last_line "$log")"
  else
    read -r status note < <("$verdict" "$log")
  fi
  record "$name" "$status" "$seconds" "$note"
}

record() {
  NAMES+=("$1") STATUSES+=("$2") DURATIONS+=("$3") NOTES+=("$4")
  echo "    $2 ($3 s) $4"
}

last_line() { grep -v '^\s*$' "$1" | tail -n 1 | cut -c1-160; }

# start_section NAME BUDGET: whether NAME is among GPU_CHECK_SECTIONS; its checks then share BUDGET seconds
start_section() {
  [[ ",$SECTIONS," == *",$1,"* ]] || return 1
  BUDGET=$2 START=$SECONDS
  printf '\n##### section %s (%s s)\n' "$1" "$2" | tee -a "$RESULT"
}

# verdicts: print "STATUS note"
checks_verdict() { echo "PASS $(last_line "$1")"; }  # gpu_checks.py exits 1 on any FAIL line

env_verdict() {
  if grep -q "CUDA available True" "$1" || [[ $DEVICE == cpu ]]; then
    echo "PASS $(grep -m1 -E '^  cuda:0|^torch ' "$1" | sed 's/^ *//' | cut -c1-150)"
  else
    echo "FAIL torch sees no CUDA device"
  fi
}

install_verdict() {
  local problems
  problems=$(grep -o 'NOT MET: .*' "$1" | cut -c1-150)
  if [[ -n $problems ]]; then echo "WARN $problems"; else echo "PASS $(grep -c '^  install ' "$1") wheels installed; pyproject dependencies met"; fi
}

distributed_verdict() {  # bench_distributed.py exits 0 even when a layout fails: read its lines
  if grep -qE '^round [0-9/]+ [^ ]+: failed' "$1"; then
    echo "FAIL $(grep -m1 -E ': failed' "$1" | cut -c1-160)"
  elif grep -qE '^[a-z0-9-]+ +unavailable' "$1"; then
    echo "WARN $(grep -E '^[a-z0-9-]+ +unavailable' "$1" | tr -s ' ' | paste -sd ';' | cut -c1-160)"
  else
    echo "PASS tokens/s vs 1 process: $(awk '$1 ~ /^(fsdp2|tp2)$/ && $2 ~ /^[0-9]+$/ {printf "%s %s, ", $1, $8}' "$1")loss $(grep -m1 -E '^maxrel' "$1" | tr -s ' ' | cut -c1-120)"
  fi
}

generate_verdict() {  # bench_generate.py: per batch size, each native runner's ratio to hf and to the bandwidth floor
  local summary
  summary=$(awk '/^batch [0-9]+:/ {batch=$2} $1 ~ /^native/ && $2 != "failed" {printf "b%s %s x%s hf, %s ms/step x%s floor; ", batch, $1, $6, $8, $10}' "$1" | sed 's/:,/,/g' | cut -c1-200)
  if grep -qE '^(hf|native[a-z-]*) +failed' "$1"; then
    echo "FAIL $(grep -m1 -E '^(hf|native[a-z-]*) +failed' "$1" | tr -s ' ' | cut -c1-160)"
  elif grep -q 'same as hf' "$1" && awk '$1 ~ /^native/ && $7 ~ /^[0-9]+\/[0-9]+$/ {split($7, r, "/"); if (r[1] != r[2]) bad=1} END {exit !bad}' "$1"; then
    echo "WARN completions differ from transformers' (near-ties in bf16?): ${summary:-no native row}"
  else
    echo "PASS ${summary:-no native row}"
  fi
}

grpo_verdict() {  # bench_grpo.py: the ratio line per completion length
  local ratios
  ratios=$(awk '$2 == "ratio" {printf "%s tokens: TRL s/step / ours %s; ", $1, $3}' "$1")
  if [[ -n $ratios ]]; then echo "PASS $ratios"; else echo "FAIL $(last_line "$1")"; fi
}

float8_verdict() {  # bench_low_precision.py float8: the ratio and loss lines, or why a runner did not finish
  local ratio loss
  ratio=$(grep -m1 '^float8 / bf16 tokens/s' "$1" | cut -d: -f2-) loss=$(grep -m1 '^float8 vs bf16 loss' "$1" | cut -d: -f2-)
  if [[ -z $ratio ]]; then
    echo "FAIL $(grep -m1 -E '^ours:(bf16|float8): ' "$1" | grep -v ': ok' | cut -c1-160)"
  elif [[ $DEVICE == cuda && ($ratio == *"NOT met"* || $loss == *OUTSIDE*) ]]; then
    echo "WARN tokens/s$ratio; loss$loss"
  else
    echo "PASS tokens/s$ratio; loss$loss"
  fi
}

fit_verdict() {  # bench_low_precision.py fit: each runner's last batch that ran, and what stopped it
  local fitted
  fitted=$(grep -E '^(ours|trl):batch[0-9]+: ' "$1" | sed 's/ MiB.*//' | paste -sd ';' | cut -c1-200)
  if [[ -z $fitted ]]; then echo "FAIL no batch ran: $(last_line "$1")"; else echo "PASS $fitted"; fi
}

bench_verdict() {  # bench_sft.py exits 0 even when a runner fails: read its lines
  local ratios
  ratios=$(grep -E '^ours(:[a-z_]+)? / ' "$1" | sed 's/, peak heap.*//' | paste -sd ';' | cut -c1-320)
  if grep -qE '^round [0-9/]+ [^ ]+: failed|the option is ignored' "$1"; then
    echo "FAIL $(grep -m1 -E ': failed|the option is ignored' "$1" | cut -c1-160)"
  elif grep -qE '^round [0-9/]+ [^ ]+: unavailable' "$1"; then
    echo "WARN $(grep -m1 ': unavailable' "$1" | cut -c1-160)"
  else
    echo "PASS ${ratios:-no ratio line}"
  fi
}

{
  echo "# GPU checks, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), device $DEVICE, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "python: $(command -v "$PYTHON"); sections ${SECTIONS}"
} >"$RESULT"

if [[ $DEVICE == cuda ]]; then
  SFT_BENCH=(--preset qwen3_0.6b --batch 4 --steps 7 --warmup 3 --peak_seconds 1 --timeout 75)
  DPO_BENCH=(--preset qwen3_0.6b --batch 4 --steps 7 --warmup 3 --timeout 90)
  DISTRIBUTED=(--preset reference --steps 8 --warmup 3 --timeout 45)
  GENERATE=(--rounds 1 --runners hf,native --timeout 120)
  GENERATE_HEAD=(--rounds 1 --runners hf,native --batch 64 --timeout 100)
  GENERATE_COMPILED=(--rounds 1 --runners native-compiled --batch 64 --timeout 170)
  GENERATE_STOPPING=(--rounds 1 --runners hf,native,native-uncompacted --batch 64 --timeout 100)
  GENERATE_LORA=(--lora --rounds 1 --runners hf,native,native-unfolded --batch 64 --timeout 100)
  GRPO=(--steps 3 --timeout 100)
  KD=(--preset qwen3_0.6b --seq 320 --completion 256 --batch 8 --steps 3 --warmup 1 --rounds 1 --timeout 100)
  ONLINE_DPO=(--trainer online_dpo --on-policy --preset qwen3_0.6b --seq 320 --completion 256 --batch 16 --steps 3
    --warmup 1 --rounds 1 --timeout 100)
  FLOAT8=(--preset qwen3_4b --layers 8 --batch 4 --steps 8 --warmup 3 --timeout 105)
  FIT=(--preset qwen3_4b --batches 8,16,32 --steps 4 --warmup 2 --timeout 60)
  MOE_LORA=(--preset gptoss_20b_2layers --timeout 95)
else
  SFT_BENCH=(--preset smoke --steps 3 --warmup 1 --peak_seconds 0.2 --threads 1 --timeout 120)
  DPO_BENCH=(--preset smoke --steps 3 --warmup 1 --threads 1 --timeout 120)
  DISTRIBUTED=(--preset smoke --steps 3 --warmup 1 --timeout 45)
  GENERATE=(--rounds 1 --runners hf,native --presets smoke --batch 8,4 --new-tokens 32 --threads 1 --timeout 60)
  GENERATE_HEAD=(--rounds 1 --runners hf,native --presets smoke --batch 8 --new-tokens 32 --threads 1 --timeout 60)
  GENERATE_COMPILED=(--rounds 1 --runners native-compiled --presets smoke --batch 8 --new-tokens 32 --threads 1 --timeout 120)
  GENERATE_STOPPING=(--rounds 1 --runners hf,native,native-uncompacted --presets smoke --batch 8 --new-tokens 32 --threads 1 --timeout 60)
  GENERATE_LORA=(--lora --rounds 1 --runners hf,native-folded,native-unfolded --presets smoke --batch 8 --new-tokens 32 --threads 1 --timeout 60)
  GRPO=(--what speed --preset smoke --lengths 16 --steps 2 --threads 1 --timeout 60)
  KD=(--preset smoke --seq 48 --completion 16 --batch 4 --steps 3 --warmup 1 --rounds 1 --threads 1 --timeout 60)
  ONLINE_DPO=(--trainer online_dpo --on-policy --preset smoke --completion 16 --batch 4 --steps 3 --warmup 1 --rounds 1
    --threads 1 --timeout 60)
  FLOAT8=(--preset smoke --steps 3 --warmup 1 --threads 1 --timeout 120)
  FIT=(--preset smoke --batches 2,4 --steps 3 --warmup 1 --threads 1 --timeout 120)
  MOE_LORA=(--preset smoke --threads 1 --timeout 90)
fi

run_check env 40 env_verdict bash -c "(nvidia-smi || echo 'nvidia-smi: not available') && $PYTHON benchmarks/gpu_env.py report"
run_check install 60 install_verdict bash -c "$PYTHON benchmarks/gpu_env.py install --target '$SITE' && echo && echo 'after install:' && $PYTHON benchmarks/gpu_env.py report"
if [[ -n $KEPT_SITE && ${STATUSES[-1]} != FAIL && ${STATUSES[-1]} != TIMEOUT ]]; then
  printf '%s' "$WHEELS_LIST" >"$SITE/.installed-from"
fi

if start_section step "${STEP_BUDGET:-480}"; then
  # a CPU rehearsal runs the kernels under Triton's interpreter where tests/test_triton_kernels.py installed Triton
  KERNELS_ENV=()
  [[ $DEVICE == cpu && -d $ROOT/.triton-cpu ]] && KERNELS_ENV=(env TRITON_INTERPRET=1 "PYTHONPATH=$PYTHONPATH:$ROOT/.triton-cpu")
  run_check kernels 60 checks_verdict "${KERNELS_ENV[@]}" "$PYTHON" benchmarks/gpu_checks.py kernels --device "$DEVICE"
  run_check bench-ac 240 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 --activation_checkpointing \
    --runners trl,ours --ours_variants default,compile,torch_kernels,keep_nothing --profile_dir "$PROFILES/sft-ac" "${SFT_BENCH[@]}"
  run_check bench 240 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 \
    --runners trl,hf,ours --ours_variants default,compile,torch_kernels,cpu_policy --profile_dir "$PROFILES/sft" "${SFT_BENCH[@]}"
fi

if start_section headline "${HEADLINE_BUDGET:-520}"; then
  run_check head-ac 210 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 --activation_checkpointing \
    --runners trl,ours --ours_variants default,compile "${SFT_BENCH[@]}"
  run_check head-gen 120 generate_verdict "$PYTHON" benchmarks/bench_generate.py --device "$DEVICE" "${GENERATE_HEAD[@]}"
  run_check head-grpo 150 grpo_verdict "$PYTHON" benchmarks/bench_grpo.py --device "$DEVICE" "${GRPO[@]}"
fi

if start_section step_more "${STEP_MORE_BUDGET:-520}"; then
  run_check dpo 150 bench_verdict "$PYTHON" benchmarks/bench_dpo.py --device "$DEVICE" --rounds 1 \
    --profile_dir "$PROFILES/dpo" "${DPO_BENCH[@]}"
  run_check packed 220 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 --packing \
    --runners trl,ours --ours_variants default,compile "${SFT_BENCH[@]}"
  run_check lora 120 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 --lora \
    --activation_checkpointing --runners trl,ours "${SFT_BENCH[@]}"
  run_check moe-lora 200 bench_verdict "$PYTHON" benchmarks/bench_expert_lora.py --device "$DEVICE" --rounds 1 "${MOE_LORA[@]}"
  run_check qlora 150 bench_verdict "$PYTHON" benchmarks/bench_sft.py --device "$DEVICE" --rounds 1 --lora \
    --activation_checkpointing --runners ours --ours_variants default,qlora,qlora_torch_dequantize "${SFT_BENCH[@]}"
fi

if start_section rollout "${ROLLOUT_BUDGET:-420}"; then
  run_check bench-gen 150 generate_verdict "$PYTHON" benchmarks/bench_generate.py --device "$DEVICE" "${GENERATE[@]}"
  run_check bench-grpo 150 grpo_verdict "$PYTHON" benchmarks/bench_grpo.py --device "$DEVICE" "${GRPO[@]}"
  run_check generation 110 checks_verdict "$PYTHON" benchmarks/gpu_checks.py generation --device "$DEVICE"
fi

if start_section rollout_more "${ROLLOUT_MORE_BUDGET:-560}"; then
  run_check gen-compiled 180 generate_verdict "$PYTHON" benchmarks/bench_generate.py --device "$DEVICE" \
    "${GENERATE_COMPILED[@]}"
  run_check bench-kd 150 bench_verdict "$PYTHON" benchmarks/bench_kd.py --device "$DEVICE" --on-policy "${KD[@]}"
  run_check gen-stopping 120 generate_verdict "$PYTHON" benchmarks/bench_generate.py --device "$DEVICE" --stopping \
    "${GENERATE_STOPPING[@]}"
  run_check gen-lora 120 generate_verdict "$PYTHON" benchmarks/bench_generate.py --device "$DEVICE" "${GENERATE_LORA[@]}"
fi

if start_section rollout_trainers "${ROLLOUT_TRAINERS_BUDGET:-420}"; then
  run_check bench-rloo 150 grpo_verdict "$PYTHON" benchmarks/bench_grpo.py --device "$DEVICE" --trainer rloo \
    "${GRPO[@]}"
  run_check bench-gkd 150 bench_verdict "$PYTHON" benchmarks/bench_kd.py --device "$DEVICE" --trainer gkd --on-policy \
    "${KD[@]}"
  run_check bench-odpo 150 bench_verdict "$PYTHON" benchmarks/bench_reward.py --device "$DEVICE" \
    "${ONLINE_DPO[@]}"
fi

if start_section checks "${CHECKS_BUDGET:-400}"; then
  run_check trainers 90 checks_verdict "$PYTHON" benchmarks/gpu_trainers.py --device "$DEVICE" --precision bf16
  run_check parity-fp32 60 checks_verdict "$PYTHON" benchmarks/gpu_checks.py parity --device "$DEVICE" --dtype fp32
  run_check parity-bf16 60 checks_verdict "$PYTHON" benchmarks/gpu_checks.py parity --device "$DEVICE" --dtype bf16
  run_check attention 75 checks_verdict "$PYTHON" benchmarks/gpu_checks.py attention --device "$DEVICE"
  run_check compile 120 checks_verdict "$PYTHON" benchmarks/gpu_checks.py compile --device "$DEVICE"
  run_check generation-compiled 150 checks_verdict "$PYTHON" benchmarks/gpu_checks.py generation --compiled \
    --device "$DEVICE"
  # the 2-rank layouts need a GPU per NCCL rank: on one GPU only the 1-process baseline would run, so skip the time
  GPUS=$([[ $DEVICE == cuda ]] && "$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 2)
  if [[ $DEVICE == cuda && ${GPUS:-0} -lt 2 ]]; then
    record distributed SKIP 0 "torch sees ${GPUS:-0} GPU(s); FSDP2 / TP2 / PP2 on NCCL need 2"
  else
    run_check distributed 70 distributed_verdict "$PYTHON" benchmarks/bench_distributed.py --device "$DEVICE" --rounds 1 \
      "${DISTRIBUTED[@]}"
  fi
fi

if start_section low_precision "${LOW_PRECISION_BUDGET:-420}"; then
  run_check float8 220 float8_verdict "$PYTHON" benchmarks/bench_low_precision.py float8 --device "$DEVICE" "${FLOAT8[@]}"
  run_check fit 200 fit_verdict "$PYTHON" benchmarks/bench_low_precision.py fit --device "$DEVICE" "${FIT[@]}"
fi

{
  echo
  echo "=== summary ($((SECONDS - RUN_START)) s in all)"
  printf '%-19s %-8s %8s  %s\n' check status seconds note
  for i in "${!NAMES[@]}"; do
    printf '%-19s %-8s %8s  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${DURATIONS[$i]}" "${NOTES[$i]}"
  done
} | tee -a "$RESULT"
if [[ -d $PROFILES ]]; then
  echo "profiles: $PROFILES ($(find "$PROFILES" -name '*-top-kernels.txt' | wc -l) runners)" | tee -a "$RESULT"
fi
echo "results: $RESULT"
if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
  cp "$RESULT" "$OUT/"
  [[ -d $PROFILES ]] && cp -r "$PROFILES" "$OUT/"
fi
