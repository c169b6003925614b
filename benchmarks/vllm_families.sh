#!/usr/bin/env bash
# Engine parity for every family through the bundled vLLM 0.24 (issue 26): `vlmreg check --engine vllm --tiny FAMILY`
# for each family, several at once, one JSON line per family in $OUT/families.STEP.jsonl, and the table for
# BENCHMARKS.md ($OUT/families.STEP.md). vLLM must be installed first (benchmarks/vllm_session.sh part0, part1, then
# part2 install), in the same warm machine:
#   run: bash benchmarks/vllm_families.sh check                  the comparisons, every installed family
#   run: bash benchmarks/vllm_families.sh train                  3 synced `vlmreg train` steps each, from the checkpoint
#                                                                the check wrote (run check first, same machine)
#   run: bash benchmarks/vllm_families.sh check qwen2_vl gemma3  some families only (any step takes a list)
#   run: bash benchmarks/vllm_families.sh both                   check, then train from its checkpoint, one command per family
#   run: bash benchmarks/vllm_families.sh inspect glm4v           why vLLM cannot inspect a family's class (its traceback)
#   run: bash benchmarks/vllm_families.sh export                 the CPU test of every family's engine checkpoint and
#                                                                processor (needs torchvision, which only this machine has)
#   bash benchmarks/vllm_families.sh table FILE.jsonl...         one table from earlier runs' lines (no GPU)
# Settings (environment): LANES_PER_GPU families at once on each GPU (default 1 with several GPUs, 3 with one),
# FRACTION each vLLM's share of its GPU (0.08), DTYPE of the check (float32), STEPS of train (3), TIMEOUT per family
# (check 300 s, train 420 s), STAGGER seconds between lane starts (20), SERVER_ARGS to replace the check's vLLM flags.
# SERVER_ARGS_<family> replaces them for one family: the bundle has no flashinfer, which vLLM 0.24 picks on Hopper for
# qwen3_5(_moe)'s gated-delta-net prefill ("No module named 'flashinfer'" at the first request), so those two take the check's
# flags plus --additional-config '{"gdn_prefill_backend": "triton"}' (vLLM's own Triton kernels), in bf16 (DTYPE_<family>),
# and gemma3 takes --attention-backend TRITON_ATTN: these are the defaults below, each replaced by its variable if set.
# Families go round-robin to the lanes; each lane runs its families one after another on its GPU.
#
# Time (estimate, not measured): a family takes about 1-2 min (imports, vLLM's start with --enforce-eager, 5 prompts,
# a sync), so 11 families fit one 10-minute command with 3 lanes on one GPU, or with one lane on each of 4+ GPUs
# (nvidia-h100-x4/x8: no sharing at all, the safe choice). train takes about as long again.
#
# Several vLLM servers on one GPU are a risk: each takes FRACTION of the memory, but vLLM 0.24 measures its own
# non-torch memory and its profile by the device's memory, which other processes change meanwhile: a neighbour that
# allocates during a start shrinks (or zeroes) the starting server's KV cache ("No available memory for the cache
# blocks"), and one that frees memory trips vLLM's assert "Error in memory profiling. Initial free memory ...". Lanes
# start STAGGER s apart to make that rarer, and a family that gave no report or whose server did not start is
# retried once, alone, at the end (its row says "retried"). Compare launch times only between runs with the same lanes.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=${PYTHONPATH:-/tmp/vsite:/tmp/site}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
FRACTION=${FRACTION:-0.08}; DTYPE=${DTYPE:-float32}; STEPS=${STEPS:-3}; STAGGER=${STAGGER:-20}
WORK=${WORK:-/tmp/engine}   # per family: vLLM's checkpoint and log, the training run (kept while the machine is warm)
# the per-family settings the runs so far needed, unless given (BENCHMARKS.md, "Every family through vLLM 0.24"): the check's
# own flags with the triton GDN prefill for qwen3_5(_moe), checked in bf16; gemma3 with TRITON_ATTN, which takes its tiny head of
# 32 in fp32 (FlexAttention's compiled graph hit torch's recompile limit on the third image shape)
CHECK_FLAGS='--enforce-eager --max-num-seqs 8 --limit-mm-per-prompt '"'"'{"image": 3, "video": 1}'"'"
GDN='--attention-backend FLEX_ATTENTION --additional-config '"'"'{"gdn_prefill_backend": "triton"}'"'"
export SERVER_ARGS_qwen3_5=${SERVER_ARGS_qwen3_5:-"$CHECK_FLAGS $GDN"} SERVER_ARGS_qwen3_5_moe=${SERVER_ARGS_qwen3_5_moe:-"$CHECK_FLAGS $GDN"}
export DTYPE_qwen3_5=${DTYPE_qwen3_5:-bfloat16} DTYPE_qwen3_5_moe=${DTYPE_qwen3_5_moe:-bfloat16}
export SERVER_ARGS_gemma3=${SERVER_ARGS_gemma3:-"$CHECK_FLAGS --attention-backend TRITON_ATTN"}
step=${1:-check}; shift || true
families=("$@")
if [ ${#families[@]} -eq 0 ] && [ "$step" != table ]; then
  mapfile -t families < <(vlmreg families --json | python3 -c "import json, sys; print('\n'.join(r['name'] for r in json.load(sys.stdin)))")
fi

keep_log() {  # what explains a failure: the first error and what led to it (vLLM logs a root cause early, e.g. a model class
  # that "failed to be inspected" after the inspection subprocess's traceback), then the last lines
  grep -n -m 3 -B 30 -E "Traceback|Error|error:" "$1" | cut -c1-400; echo "..."; tail -n 40 "$1"
}

table() {  # the markdown table of JSON lines (one per family), for BENCHMARKS.md
  python3 - "$@" <<'EOF'
import json, sys
rows = {}  # a family's lines of several files (check, then train) make one row
for line in (line for path in sys.argv[1:] for line in open(path) if line.strip()):
    r = json.loads(line)
    if r["family"] in rows:
        first = rows[r["family"]]
        first["comparisons"] += r["comparisons"]
        first["ok"] = first["ok"] and r["ok"]
        first["error"] = first.get("error") or r.get("error")
        first["retried"] = first.get("retried") or r.get("retried")
        first["launch_s"] = first.get("launch_s") or r.get("launch_s")
    else:
        rows[r["family"]] = r
rows = list(rows.values())
print("| family | prompt ids = processor (text/1/2/3 images) | = vlmreg | = AutoProcessor | logprobs max diff | after sync | mismatch_kl per step | vLLM start | verdict |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    marks = {"PASS": "yes", "FAIL": "**no**", "SKIP": "-"}
    cases = ("text only", "1 image", "2 images", "3 images")
    proc = " / ".join(next((marks[c["status"]] for c in r["comparisons"] if c["name"] == f"{k}: prompt ids vs the processor"), "-") for k in cases)
    mine = " / ".join(next((marks[c["status"]] for c in r["comparisons"] if c["name"] == f"{k}: prompt ids vs vlmreg"), "-") for k in cases)
    auto = " / ".join(next((marks[c["status"]] for c in r["comparisons"] if c["name"] == f"{k}: prompt ids vs AutoProcessor"), "-") for k in cases)
    diffs = [c["value"] for c in r["comparisons"] if c["name"].endswith("logprobs vs a plain forward") and not c["name"].startswith("after") and c["value"] is not None]
    after = [c for c in r["comparisons"] if c["name"].startswith("after a weight sync") and c["name"].endswith("plain forward")]
    kls = [c["value"] for c in r["comparisons"] if c["name"].startswith("train step")]
    verdict = "PASS" if r["ok"] else "FAIL: " + (r.get("error") or "; ".join(f"{c['name']}: {c['detail']}" for c in r["comparisons"] if c["status"] == "FAIL"))
    verdict = verdict.replace("|", "/").replace("\n", " ")[:300] + (" (retried)" if r.get("retried") else "")
    print(f"| {r['family']} | {proc} | {mine} | {auto} | {max(diffs):.1e} ({r['dtype']}) |" if diffs else f"| {r['family']} | {proc} | {mine} | {auto} | - |", end="")
    print(f" {after[0]['value']:.1e} |" if after and after[0]['value'] is not None else " - |", end="")
    print(f" {', '.join(f'{k:.1e}' for k in kls if k is not None) or '-'} | {str(r['launch_s']) + ' s' if r.get('launch_s') else '-'} | {verdict} |")
EOF
}

one() {  # one family: its JSON line, or one that says why there is none
  local family=$1 kind=$2 log="$OUT/$1.$2"
  local dtype_of="DTYPE_$family"  # one family's dtype instead (DTYPE_qwen3_5=bfloat16: vLLM's gated-delta-net kernels refuse float32)
  local args=(--tiny "$family" --json --gpu-memory-fraction "$FRACTION" --dtype "${!dtype_of:-$DTYPE}" --output-dir "$WORK/$family")
  [ -n "${SERVER_ARGS:-}" ] && args+=(--server-args "$SERVER_ARGS")
  local own="SERVER_ARGS_$family"  # one family's flags instead (e.g. SERVER_ARGS_qwen3_5 with the triton GDN prefill, below)
  [ -n "${!own:-}" ] && args+=(--server-args "${!own}")
  local limit=${TIMEOUT:-300}
  if [ "$kind" = train ]; then args+=(--no-parity --train "$STEPS"); limit=${TIMEOUT:-420}; fi
  if [ "$kind" = both ]; then args+=(--train "$STEPS"); limit=${TIMEOUT:-600}; fi
  local started=$SECONDS
  timeout -s INT -k 60 "$limit" vlmreg check --engine vllm "${args[@]}" > "$log.json" 2> "$log.err"
  local code=$?
  if [ "$kind" != train ]; then keep_log "$WORK/$family/vllm.log" > "$log.vllm.log" 2>/dev/null; fi  # the check's server
  if [ "$kind" != check ]; then
    keep_log "$WORK/$family/train/vllm.log" > "$log.train-vllm.log" 2>/dev/null
    tail -n 40 "$WORK/$family/train.log" > "$log.train.log" 2>/dev/null
  fi
  python3 - "$family" "$code" "$log" "$((SECONDS - started))" "${RETRIED:-}" >> "$OUT/families.$kind.jsonl" <<'EOF'
import json, sys
family, code, log, seconds, retried = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), bool(sys.argv[5])
lines = [l for l in open(log + ".json").read().splitlines() if l.startswith("{")]
if lines:
    row = json.loads(lines[-1])
else:
    err = open(log + ".err", errors="replace").read().strip().splitlines()[-6:]
    why = "timed out (stopped)" if code == 124 else f"exit code {code}"
    row = {"family": family, "ok": False, "comparisons": [], "dtype": "-", "error": f"no report: {why}; stderr ends: {' | '.join(err)}"}
row.update(exit_code=code, wall_s=seconds, retried=retried)
print(json.dumps(row))
EOF
  echo "$family $kind: exit $code after $((SECONDS - started)) s"
}

case $step in
  table) table "${families[@]}"; exit 0 ;;
  export)  # tests/inference/test_engine_export.py where torchvision is (every family's engine processor), no GPU use
    if python3 -c "import pytest" 2> /dev/null; then
      python3 -m pytest -q -p no:cacheprovider -rs tests/inference/test_engine_export.py 2>&1 | tail -15 | tee "$OUT/export_tests.txt"
    else echo "pytest is not importable here: bring its wheel (and pluggy's, iniconfig's) in .whl/"; fi
    exit 0 ;;
  inspect)  # why vLLM cannot inspect a family's model class: import its module and inspect it as vLLM's start does, traceback kept
    for family in "${families[@]}"; do
      echo "== inspect $family"
      timeout 200 python3 - "$family" <<'PY' 2>&1 | grep -vE "UserWarning|warnings.warn" | tail -n 30 | tee "$OUT/$family.inspect.txt"
import sys, traceback
import vlmreg
from vlmreg.config import parse_config
loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": sys.argv[1], "size": "tiny"}, "trainer": {"device": "cpu"}}))
names = [type(loaded.model).__name__]
from vllm.model_executor.models.registry import ModelRegistry, _VLLM_MODELS
for name in names:
    module, cls = _VLLM_MODELS.get(name, (None, None))
    print(f"{sys.argv[1]}: architecture {name} -> vllm.model_executor.models.{module}.{cls}")
    try:
        import importlib
        model_cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
        from vllm.model_executor.models.registry import _ModelInfo
        print("inspected:", _ModelInfo.from_model_cls(model_cls))
    except BaseException:
        traceback.print_exc()
PY
    done
    exit 0 ;;
  check|train|both) ;;
  *) echo "unknown step $step (check, train, both, inspect, export, table)"; exit 2 ;;
esac
# GPU_LIST: the GPUs to use (default every one), e.g. GPU_LIST=2,3 while other work holds GPUs 0 and 1
read -ra GPU_IDS <<< "$(echo "${GPU_LIST:-$(seq -s, 0 $(( $(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || echo 1) - 1 )))}" | tr , ' ')"
GPUS=${#GPU_IDS[@]}; [ "$GPUS" -ge 1 ] || { GPU_IDS=(0); GPUS=1; }
LANES_PER_GPU=${LANES_PER_GPU:-$([ "$GPUS" -gt 1 ] && echo 1 || echo 3)}
lanes=$((GPUS * LANES_PER_GPU))
echo "== $step ${families[*]} ($GPUS GPU(s), $lanes lane(s), FRACTION=$FRACTION DTYPE=$DTYPE) $(date +%T)"
rm -f "$OUT/families.$step.jsonl"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for ((lane = 0; lane < lanes; lane++)); do
  mine=()
  for ((i = lane; i < ${#families[@]}; i += lanes)); do mine+=("${families[i]}"); done
  [ ${#mine[@]} -eq 0 ] && break
  (export CUDA_VISIBLE_DEVICES=${GPU_IDS[$((lane % GPUS))]}; for family in "${mine[@]}"; do one "$family" "$step"; done) &
  sleep "$STAGGER"
done
wait
# a family whose server did not start (often two start-ups in one GPU's memory at once) gets one more try, alone
mapfile -t again < <(python3 -c "
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if not r['ok'] and ('did not start' in (r.get('error') or '') or 'no report' in (r.get('error') or '')):
        print(r['family'])" "$OUT/families.$step.jsonl")
for family in "${again[@]}"; do  # alone, while the command's time allows (RETRY_BEFORE s since the start)
  if [ "$SECONDS" -lt "${RETRY_BEFORE:-360}" ]; then RETRIED=1 one "$family" "$step"; else echo "$family: not retried ($SECONDS s gone)"; fi
done
python3 -c "
import json, sys
rows = {r['family']: r for r in map(json.loads, open(sys.argv[1]))}  # a retried family's last line stands
open(sys.argv[1], 'w').write(''.join(json.dumps(r) + '\\n' for r in rows.values()))" "$OUT/families.$step.jsonl"
left=$(pgrep -f "vllm.entrypoints.openai.api_server" | wc -l)
[ "$left" -gt 0 ] && echo "warning: $left vLLM server process(es) still running after the checks"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
table "$OUT/families.$step.jsonl" | tee "$OUT/families.$step.md"
