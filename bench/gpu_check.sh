#!/usr/bin/env bash
# The standing GPU list in one command, for a lent GPU machine (the device tool's `run`): the
# decode step's host time vs a replayed graph's GPU time, logprobs, sampling, grammar masks and
# the prefix cache on the device, then the CUDA-only tests. Run from a checkout's root (or a
# `git archive` snapshot of it):
#
#   bash bench/gpu_check.sh
#
# It expects, beside the code (none of it is committed; build it on the machine you call from):
#   .whl/*.whl            wheels the device image lacks (pydantic(-core, -settings), python-dotenv,
#                         typing-inspection, annotated-types, typing_extensions, redis, xgrammar,
#                         apache-tvm-ffi, and transformers to match the project's version);
#                         installed into /tmp/site, put first on PYTHONPATH
#   .carry/tok            SmolLM2's tokenizer, saved with save_pretrained (random-weight models)
#   .carry/logits128.pt   bench/sampling.py --rows 1,16,64,128 --save-logits (SmolLM2's real logits)
# Made on the calling machine like this (session 19; the device image has python 3.12 and lacks these packages):
#   git archive HEAD | tar -x -C .gpu_snapshot     # a fixed snapshot, listed in .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 ... -d .gpu_snapshot/.whl NAME==VERSION   # versions as in .venv
#   AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF).save_pretrained(".gpu_snapshot/.carry/tok")
# then `run` with carry [".gpu_snapshot"] and `cd .gpu_snapshot && bash bench/gpu_check.sh` (~170 s on an H200).
# Full logs and the JSON results go to $OUT (gpu_check.log, results.tar.gz: two files, within the
# device tool's eight); a summary is printed last. Each step has a time cap and the whole run a
# deadline (DEADLINE seconds, default 400), so one hung step does not take the others with it.
# Env: PY (python3), DEVICE (cuda), WHEELS=0 (skip the install), ONLY="engine_step logprobs" (those
# steps alone: step names as in the summary), QUICK=1 (tiny sizes: a smoke run of the script's logic on CPU).
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
DEADLINE=${DEADLINE:-400}
TOK=.carry/tok
L=bench/out/gpu_check_logs   # per-step logs (bench/out is gitignored)
rm -rf "$L"; mkdir -p "$OUT" "$L"; touch "$L/.start"
LOG="$OUT/gpu_check.log"
: > "$LOG"
declare -a SUMMARY=()

say() { echo "$@" | tee -a "$LOG"; }
# this run's logs and the JSON files the benches wrote during it (bench/out may hold older ones)
pack() { find bench/out -type f -newer "$L/.start" -print0 | tar -czf "$OUT/results.tar.gz" --null -T - 2>/dev/null; }

# step NAME CAP CMD...: runs CMD under min(CAP, time left) seconds, logs to $L/NAME.log and $LOG
step() {
    local name=$1 cap=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local left=$((DEADLINE - SECONDS - 5))
    if (( left < 15 )); then SUMMARY+=("$name: SKIPPED (deadline)"); say "== $name skipped: ${left}s left"; return; fi
    local t=$(( cap < left ? cap : left )) start=$SECONDS
    say "== $name (cap ${t}s, at ${SECONDS}s): $*"
    timeout -k 5 "$t" "$@" 2>&1 | tee "$L/$name.log" | tee -a "$LOG" | grep -v -E "it/s\]|s/it\]"
    local rc=${PIPESTATUS[0]}
    SUMMARY+=("$name: rc=$rc in $((SECONDS - start))s")
    say "== $name rc=$rc ($((SECONDS - start))s)"
    pack
}

if [ "$QUICK" = 1 ]; then
    ES=(--rows 1,2 --steps 3 --prompt 8); LP=(--shapes tiny --rows 4 --asking 0,2,4 --steps 3); SR=(--rows 1,4 --repeat 2)
    SS=(--rows 1,4 --repeat 2); GS=(--rows 4 --constrained 0,2 --steps 2 --rounds 1)
    PX=(--requests 2 --system-tokens 100 --answer-tokens 2 --modes sequential)
else
    ES=(--rows 1,16,64,256 --steps 100); LP=(--shapes tiny,smollm2-135m --rows 64 --asking 0,8,64 --steps 30)
    SR=(--rows 1,16,64,128 --repeat 15); SS=(--rows 1,16,64,256 --repeat 15); GS=(--rows 64 --steps 20 --rounds 2)
    PX=(--requests 16 --system-tokens 1000 --answer-tokens 32)
fi

# ---- environment --------------------------------------------------------------------------
if [ "${WHEELS:-1}" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -3 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
  uname -r; nproc
  $PY - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ["torch", "triton", "transformers", "tokenizers", "huggingface_hub", "numpy", "pydantic",
             "pydantic_settings", "msgpack", "xgrammar", "redis", "pytest", "gguf", "prometheus_client",
             "pythonjsonlogger"]:
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except Exception as exc:   # noqa: BLE001
        print(f"  {name} MISSING ({type(exc).__name__}: {exc})")
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("cuda", torch.version.cuda, p.name, p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
else:
    print("cuda not available")
EOF
} 2>&1 | tee -a "$LOG"

# ---- benches ------------------------------------------------------------------------------
step engine_step 110 $PY bench/engine_step.py --device "$DEVICE" --random-weights smollm2-135m --tokenizer "$TOK" "${ES[@]}"
if [ ${#SUMMARY[@]} -gt 0 ] && [[ "${SUMMARY[-1]}" == engine_step:* && "${SUMMARY[-1]}" != *"rc=0 "* ]]; then   # the parent hides its child's stderr: run the child in view
    step engine_step_child 60 $PY bench/engine_step.py --child . --device "$DEVICE" --random-weights smollm2-135m \
        --tokenizer "$TOK" --rows 1,256 --steps 20 --prompt 128 --sampling greedy
fi
step logprobs 70 $PY bench/logprobs.py --device "$DEVICE" --tokenizer "$TOK" "${LP[@]}"
step sampling_real 35 $PY bench/sampling.py --device "$DEVICE" --logits .carry/logits128.pt "${SR[@]}"
[ -f bench/out/sampling.json ] && mv bench/out/sampling.json bench/out/sampling_real.json
step sampling_synth 35 $PY bench/sampling.py --device "$DEVICE" --logits synthetic "${SS[@]}"
step grammar_step 80 $PY bench/grammar_step.py --device "$DEVICE" --tokenizer "$TOK" "${GS[@]}"
step prefix 70 $PY bench/prefix_device.py --device "$DEVICE" --tokenizer "$TOK" "${PX[@]}"
# the CUDA-only test (it skips without CUDA), then the kernel's engine checks as a script
step pytest_cuda 150 $PY -m pytest -q -p no:cacheprovider tests/test_paged_attention.py -k on_cuda -rs

# ---- summary ------------------------------------------------------------------------------
{
echo; echo "======== summary (${SECONDS}s) ========"
printf '%s\n' "${SUMMARY[@]}"
for f in engine_step logprobs sampling_real sampling_synth grammar_step prefix; do
    [ -f "$L/$f.log" ] || continue
    echo "--- $f"; grep -E '^\|' "$L/$f.log" | tail -n 40
done
echo "--- pytest"; tail -n 5 "$L/pytest_cuda.log" 2>/dev/null
} 2>&1 | tee -a "$LOG"
pack
