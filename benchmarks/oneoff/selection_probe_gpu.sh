set -u
[[ -n ${SKIP_SETUP:-} ]] || EXP=experiments/ruler_gemma3_options_gpu.json LIMIT=1 bash benchmarks/gpu/ruler_32k_runs.sh >/dev/null 2>&1
eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)"
mkdir -p $OUT
P="python3 benchmarks/oneoff/selection_probe.py --ruler gemma3-270m:ruler_fwe --length 16384 --samples 50 --requests 50 --new-tokens ${NEW:-8} --device cuda --dtype bfloat16"
for c in '{"algorithm": "quest", "sparse_policy": "always", "min_sparse_prompt_len": 0}' \
         '{"algorithm": "quest", "sparse_policy": "always", "min_sparse_prompt_len": 0, "device_buffer_tokens": 2144, "extra": {"dense_first_layers": 0}}' \
         '{"algorithm": "quest", "store": "resident", "sparse_policy": "always", "min_sparse_prompt_len": 1000000000}'; do
  echo "=== $c"; timeout 150 $P --config "$c" 2>&1 | grep -v "it/s" | tail -${TAILN:-53}
done > $OUT/selprobe.txt
tail -c 3000 $OUT/selprobe.txt
