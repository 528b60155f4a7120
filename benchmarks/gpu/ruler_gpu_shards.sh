#!/usr/bin/env bash
# Run a RULER experiment on every GPU of one host at once: one `sparse-framework eval --shard
# i/N` process per GPU, each from its own copy of the results measured so far, stopped after
# LIMIT seconds (a device call lasts at most 10 minutes; a cell cut off is simply not written),
# then the copies merged into $OUT/ruler_gpu.jsonl (each cell once). Copy that file over
# benchmarks/results/ruler_gpu.jsonl here and render the page with `eval --report-only`.
#
#   bash benchmarks/gpu/smollm2_gpu.sh join && eval "$(bash benchmarks/gpu/smollm2_gpu.sh env)" \
#     && tar xzf .gpu_carry/part2/ruler_cache.tgz -C "$SPARSE_FRAMEWORK_CACHE" \
#     && LIMIT=480 bash benchmarks/gpu/ruler_gpu_shards.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-ruler_shards}
LIMIT=${LIMIT:-480}
EXP=${EXP:-experiments/ruler_gpu.json}
PARTIAL=${PARTIAL:-benchmarks/results/ruler_gpu.jsonl}
N=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
mkdir -p "$OUT"
for ((i = 0; i < N; i++)); do
    cp "$PARTIAL" "$OUT/shard$i.jsonl"
    CUDA_VISIBLE_DEVICES=$i timeout "$LIMIT" sparse-framework eval "$EXP" --device cuda --shard "$i/$N" \
        --out "$OUT/shard$i.jsonl" --no-progress >"$OUT/shard$i.log" 2>&1 &
done
wait
python3 - "$OUT" "$N" "$PARTIAL" <<'PY'
import json, sys
from pathlib import Path
out, n, partial = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
seen, lines = set(), []
for path in [partial] + [out / f"shard{i}.jsonl" for i in range(n)]:
    for line in path.read_text().splitlines():
        try:
            cell = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the time limit
        if cell["id"] not in seen:
            seen.add(cell["id"])
            lines.append(line)
(out / "ruler_gpu.jsonl").write_text("\n".join(lines) + "\n")
before = sum(1 for _ in partial.read_text().splitlines())
print(f"{len(lines)} cells in {out / 'ruler_gpu.jsonl'} ({len(lines) - before} new, {n} shards)")
PY
