#!/usr/bin/env bash
# Decode throughput of a sparse server (`rstar serve MODEL --gates GATES`) against a dense
# `vllm serve MODEL` on the same GPU, one after the other, with `vllm bench serve` (random
# prompts of INPUT_LEN tokens, OUTPUT_LEN generated tokens each, ignoring EOS, CONCURRENCY at a
# time). For a machine with vLLM 0.32.0 and rstar-pipelines installed (`pip install
# '.[gpu]'`) and one GPU; both servers use the gates' block size as page size, so the only
# difference is the attention backend.
#
#     bash benchmarks/vllm_serve_bench.sh MODEL GATES [INPUT_LEN] [OUTPUT_LEN] [CONCURRENCY]
#
# Defaults: 32768-token prompts, 512 new tokens, 8 at a time, 32 prompts (NUM_PROMPTS). Results
# (server logs, `vllm bench serve` JSON, a Markdown table of output tokens/s) go to $OUT, or to
# ./vllm-serve-bench-out.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,13p' "$0"
  exit 2
fi
model=$1 gates=$2 input_len=${3:-32768} output_len=${4:-512} concurrency=${5:-8}
num_prompts=${NUM_PROMPTS:-32}
out="${OUT:-vllm-serve-bench-out}"
mkdir -p "$out"
block=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['block_size'])" \
  "$gates/gate_config.json")
max_len=$((input_len + output_len + block))
port=8011
server=""
stop() {  # the server started last, if any (it exits with a signal's status: not an error)
  if [ -n "$server" ]; then
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
  fi
  server=""
}
trap stop EXIT

wait_ready() {  # the server's /v1/models answers, or it died
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && return 0
    kill -0 "$server" 2>/dev/null || { echo "the server exited: see $1"; return 1; }
    sleep 2
  done
  echo "the server did not answer in 20 minutes: see $1"
  return 1
}

bench() {  # $1: label, $2: served model name
  vllm bench serve --backend openai --base-url "http://127.0.0.1:$port" --model "$2" \
    --tokenizer "$model" --dataset-name random --random-input-len "$input_len" \
    --random-output-len "$output_len" --ignore-eos --num-prompts "$num_prompts" \
    --max-concurrency "$concurrency" --save-result --result-dir "$out" \
    --result-filename "$1.json" | tee "$out/$1.bench.log"
}

echo "== sparse: rstar serve (log: $out/sparse.server.log)"
rstar serve "$model" --gates "$gates" --port "$port" --served-model-name sparse -- \
  --max-model-len "$max_len" >"$out/sparse.server.log" 2>&1 &
server=$!
wait_ready "$out/sparse.server.log"
bench sparse sparse
stop

echo "== dense: vllm serve (log: $out/dense.server.log)"
vllm serve "$model" --port "$port" --served-model-name dense --block-size "$block" \
  --max-model-len "$max_len" >"$out/dense.server.log" 2>&1 &
server=$!
wait_ready "$out/dense.server.log"
bench dense dense
stop

python - "$out" "$input_len" "$output_len" "$concurrency" <<'EOF' | tee "$out/summary.md"
import json, sys
out, input_len, output_len, concurrency = sys.argv[1:]
runs = {name: json.load(open(f"{out}/{name}.json")) for name in ("sparse", "dense")}
print(f"{input_len}-token prompts, {output_len} new tokens, {concurrency} at a time\n")
print("| server | output tok/s | median TPOT ms |\n|---|---|---|")
for name, r in runs.items():
    print(f"| {name} | {r['output_throughput']:.1f} | {r['median_tpot_ms']:.2f} |")
ratio = runs["sparse"]["output_throughput"] / runs["dense"]["output_throughput"]
print(f"\nsparse / dense output throughput: {ratio:.2f}x")
EOF
