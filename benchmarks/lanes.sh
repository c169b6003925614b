#!/usr/bin/env bash
# Several GPU steps at once, one lane per group of GPUs, so one device call keeps every GPU of the machine busy:
#   bash benchmarks/lanes.sh "NAME|COMMAND" "NAME|COMMAND" ...
# Each COMMAND runs under `bash -c` at the same time as the others, with its own OUT (/tmp/lanes/NAME, so each lane's
# files stay apart and the device's 8-file limit is kept): the commands choose their GPUs themselves
# (CUDA_VISIBLE_DEVICES=N for vllm_session.sh's one-GPU steps, GPU_LIST=N for vllm_families.sh, LORA_GPU=N for one
# LoRA run; syncratio uses GPUs 0-2 by itself). When every lane has ended, each lane's output is printed in turn and
# its OUT archived to $OUT/lane-NAME.tgz (files over 15 MB left out, named). vLLM must be installed first
# (vllm_session.sh ... part2 install, in an earlier command of the same warm machine).
# Example (issue 25's sync ratio on GPUs 0-2 while GPU 3 profiles vLLM's engine, then checks gemma3):
#   bash benchmarks/lanes.sh "sync|STEPS=8 SYNC_MAX_TOKENS=32 bash benchmarks/vllm_session.sh syncratio" \
#     "gpu3|CUDA_VISIBLE_DEVICES=3 bash benchmarks/vllm_session.sh rollout-profile; GPU_LIST=3 bash benchmarks/vllm_families.sh both gemma3"
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
names=()
for lane in "$@"; do
  name=${lane%%|*}; command=${lane#*|}
  mkdir -p "/tmp/lanes/$name"
  (OUT=/tmp/lanes/$name bash -c "$command" > "/tmp/lanes/$name.log" 2>&1; echo "lane $name: exit $?" >> "/tmp/lanes/$name.log") &
  names+=("$name"); echo "lane $name started $(date +%T): $command"
done
wait
for name in "${names[@]}"; do
  echo "===== lane $name"; cat "/tmp/lanes/$name.log"
  big=$(find "/tmp/lanes/$name" -type f -size +15M)
  [ -n "$big" ] && echo "left out (over 15 MB): $big"
  tar czf "$OUT/lane-$name.tgz" -C "/tmp/lanes" $(find "/tmp/lanes/$name" -type f -size -15M -printf "$name/%P\n") "$name.log" 2>/dev/null
done
