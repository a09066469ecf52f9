#!/usr/bin/env bash
# Refresh the bundled tg-tiny family end to end: more training from its committed weights,
# export over the bundle, evaluation, recalibration of every per-family setting, benchmarks.
# Each step runs once; an interrupted one resumes when the script is rerun (training keeps
# checkpoints in $WORK: 2 cores need more than one 180-minute session for all of it).
#
#   WORK=/root/treegraft-train/tg-tiny bash examples/refresh_family.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-.train/tg-tiny}
FAMILY=treegraft_mlx/fixtures/tg-tiny
CAL=benchmarks/calibration
DONE=$WORK/refresh-steps
mkdir -p "$DONE"

# step NAME [DIR] -- COMMAND...: run COMMAND unless NAME finished before; DIR (results of the
# old family that the command would resume from) is emptied when NAME first starts.
step() {
  local name=$1 stale=""; shift
  if [[ $1 != -- ]]; then stale=$1; shift; fi
  shift
  if [[ -e $DONE/$name.done ]]; then echo "== $name: done before"; return; fi
  if [[ -n $stale && ! -e $DONE/$name.started ]]; then rm -rf "$stale"; fi
  touch "$DONE/$name.started"
  echo "== $name: $*"
  "$@"
  touch "$DONE/$name.done"
}

# 3x the first run's tokens in all: target 3.7M + 7.5M, drafter 0.68M + 1.4M
step train -- python examples/train_tiny_family.py --work "$WORK" --out "$FAMILY" \
  --resume-from "$FAMILY" --target-tokens 7.5e6 --drafter-tokens 1.4e6 --outputs 2048
step evaluate -- python examples/evaluate_family.py --work "$WORK" --json "$FAMILY/evaluation.json"
step budget -- treegraft calibrate-budget --write
step acceptance "$WORK/acceptance" -- treegraft calibrate-acceptance \
  --work-dir "$WORK/acceptance" --write
step acceptance-sampled "$WORK/acceptance-sampled" -- treegraft calibrate-acceptance \
  --temp 0.7 --top-p 0.95 --work-dir "$WORK/acceptance-sampled" --write
step scheduler "$CAL/tg-tiny" -- treegraft calibrate --work-dir "$CAL/tg-tiny" --write
step scheduler-sampled "$CAL/tg-tiny-sampled" -- treegraft calibrate --temp 0.7 --top-p 0.95 \
  --work-dir "$CAL/tg-tiny-sampled" --write
STRATEGIES=ar,mlx_lm,mlx_lm_spec,chain,ngram,draft,treegraft,treegraft-learned,treegraft-fixed:1,ngram@budget,treegraft@budget
step bench-greedy -- treegraft bench --prompts benchmarks/prompts/public.jsonl --per-category 2 \
  --max-tokens 128 --repeat 2 --strategies "$STRATEGIES" --json benchmarks/results/greedy.json
step bench-sampled -- treegraft bench --prompts benchmarks/prompts/public.jsonl \
  --per-category 2 --max-tokens 128 --repeat 2 --strategies "$STRATEGIES" --temp 0.7 \
  --top-p 0.95 --seed 0 --json benchmarks/results/sampled.json
