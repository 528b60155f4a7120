# Sourced by the GPU run scripts (tp_gpu_runs.sh, policy_gpu_runs.sh): `run NAME LIMIT_S COMMAND...`
# runs COMMAND under a time limit with its output in $OUT/NAME.log and prints one status line
# (the log's tail when it failed), so that one failed run never stops the rest of a device call.
run() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $((SECONDS - start)) s"
    [[ $rc == 0 ]] || tail -n 5 "$OUT/$name.log" | sed 's/^/    /'
}
