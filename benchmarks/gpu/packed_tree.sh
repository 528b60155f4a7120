# shellcheck shell=bash
# Sourced by the GPU scripts that run HEAD's packed tree (side_by_side_runs.sh, serve_curve_runs.sh):
# `unpack_tree HERE TREE SITE` unpacks .gpu_carry/tree/tree.tar.xz into TREE once per commit
# (removing SITE, the install of an older tree, with it) and exports SF_COMMIT, the commit every
# result records (the machine's copy has no .git).
unpack_tree() {
    local here=$1 tree=$2 site=$3 commit
    commit=$(cat "$here/.gpu_carry/tree/COMMIT")
    if [[ ! -f $tree/.packed || $(cat "$tree/.packed") != "$commit" ]]; then
        rm -rf "$tree" "$site" && mkdir -p "$tree"
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$here/.gpu_carry/tree/tree.tar.xz" "$tree"
        echo "$commit" >"$tree/.packed"
    fi
    export SF_COMMIT=$commit
}
