#!/usr/bin/env bash
# The README's test command: install into ./.venv if needed (the CUDA or the CPU builds, as this
# machine needs), then run the suite, one pytest process per tier (tests/conftest.py says what
# each tier holds), so no test depends on which modules ran before it in the same process. The
# system tier is run in two parts, one per lane: the whole-system runs on local clusters and the
# benchmarks' smokes (system_lane_files, but for the smokes first_lane_ids names) in a second lane
# beside the other tiers (its log printed at the end), every other system test at the end of the
# first lane (on a GPU host the lanes run one after the other). Every tier's time and exit, each
# lane's time and the total are printed last.
#
#   bash scripts/test.sh                 # every tier (what CI runs)
#   bash scripts/test.sh --fast          # the pure, single-process tier only (a few minutes)
#   bash scripts/test.sh --gpu           # the gpu tier alone (tests/*/test_gpu_*.py), on a CUDA machine
#                                        # (fails when CUDA is missing or no gpu test ran)
#   bash scripts/test.sh tests/<folder>/test_x.py -k name   # anything else: one pytest run with these arguments
#
# Installs the builds this machine needs first (scripts/install.sh: CUDA builds on a machine with
# an NVIDIA GPU, the CPU builds elsewhere). Exits non-zero on any failure (and on "no tests
# collected"), after running every tier. On a machine without CUDA the gpu tier's tests are
# deselected and counted ("N gpu tests deselected: no CUDA"), not failed; on a CUDA machine a gpu
# tier that selects nothing fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# Bytecode caching on, whatever the environment says (this machine's sets
# PYTHONDONTWRITEBYTECODE=1): the suite starts several hundred Python processes that import the
# same project modules, and each tier's pytest rewrites the same test files; with the cache
# (__pycache__/, git-ignored) each is compiled once instead of in every process.
unset PYTHONDONTWRITEBYTECODE
# The gpu tier's files (tests/project/test_tests_layout.py keeps every gpu test in them).
gpu_tests=(tests/*/test_gpu_*.py)
# The system tests the second lane runs (the rest of the system tier runs in the first lane); chosen
# so that the lanes end near each other (benchmarks/RESULTS.md, "The test suite").
# The smokes, the end-to-end and the crash-resume modules are next to each other: they share one
# cluster (tests/support/cluster.py, SHARED_CLUSTER_MODULES).
system_lane_files=(tests/system/test_benchmarks_smoke.py tests/system/test_end_to_end.py
                   tests/system/test_crash_resume.py tests/system/test_cluster_path.py
                   tests/system/test_demo_tools_smoke.py tests/system/test_scale_benchmark.py
                   tests/launch/test_placement_ray.py tests/rewards/test_verifier_slots.py)
# Smokes of test_benchmarks_smoke.py (by their ids) that the first lane runs instead, at its end:
# they start engines of their own, not the shared cluster, and a file is too coarse to balance by.
first_lane_smokes=(long_context)
first_lane_ids=()
for smoke in "${first_lane_smokes[@]}"; do
    first_lane_ids+=("tests/system/test_benchmarks_smoke.py::test_benchmark_smoke_prints_its_summary[$smoke]")
done

if [[ "${1:-}" == "--gpu" ]]; then
    # The gpu tier alone (tests/*/test_gpu_*.py), with no install: the lent GPU machine has torch
    # and transformers but no network (and no Ray or vLLM). The project venv is used where it
    # exists, else the machine's python. It fails loudly when this python sees no CUDA device or
    # when no gpu test ran: a green gpu tier that ran nothing would say nothing.
    python=.venv/bin/python
    [[ -x "$python" ]] || python=python3
    if ! "$python" -c "import pytest, torch" 2>/dev/null; then
        echo "scripts/test.sh --gpu: $python cannot import pytest and torch; install them there first" >&2
        exit 1
    fi
    if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "scripts/test.sh --gpu: $python's torch $("$python" -c 'import torch; print(torch.__version__)') sees no CUDA device: run it on a GPU machine (bash scripts/install.sh installs the CUDA builds there)" >&2
        exit 1
    fi
    rc=0
    "$python" -m pytest -m gpu -rs --durations=25 "${gpu_tests[@]}" "${@:2}" || rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "scripts/test.sh --gpu: no gpu test was collected" >&2
        exit 1
    fi
    exit $rc
fi
bash scripts/install.sh
source scripts/device.sh
device=$(detect_device)

if [[ $# -gt 0 && "$1" != "--fast" ]]; then
    exec .venv/bin/python -m pytest "$@"
fi

# tier name, its marker expression, then what pytest collects ('' for the whole suite): each test
# runs in exactly one tier (the last of ray < vllm < distributed < system < gpu that it carries;
# unmarked tests are fast). The system tier runs as two parts: `system` is system_lane_files but
# first_lane_ids, `system-rest` every other system test. The gpu tier collects its own files only:
# collecting the whole suite to deselect it cost ~15 s on 2 cores.
tiers=(
    "fast" "not (ray or vllm or distributed or system or gpu)" ""
    "ray" "ray and not (vllm or distributed or system or gpu)" ""
    "vllm" "vllm and not (distributed or system or gpu)" ""
    "distributed" "distributed and not (system or gpu)" ""
    "system-rest" "system and not gpu" "${system_lane_files[*]/#/--ignore=} tests ${first_lane_ids[*]}"
    "gpu" "gpu" "${gpu_tests[*]}"
    "system" "system and not gpu" "${system_lane_files[*]} ${first_lane_ids[*]/#/--deselect=}"
)

# own_files NAME: the test files holding tier NAME's tests, from the list the fast tier wrote
# (tests/conftest.py, TIER_MANIFEST_ENV); system-rest's without system_lane_files. Nothing when
# there is no list (a fast tier that did not collect): the tier then collects as the table says.
own_files() {
    local tier=${1%-rest} listed file
    [[ -s "$results/tier_files" ]] || return 0
    while read -r listed file; do
        if [[ "$listed" == "$tier" && !( "$1" == "system-rest" && " ${system_lane_files[*]} " == *" $file "* ) ]]; then
            echo "$file"
        fi
    done < "$results/tier_files"
}

# run_tiers LANE NAME EXPRESSION PATHS [NAME EXPRESSION PATHS ...]: the tiers one after the other;
# each tier's exit and time go to $results/tiers.LANE (one "name rc seconds" line each). The fast
# tier collects the whole suite and writes which files hold each tier's tests; the ray, vllm,
# distributed and system-rest tiers after it then collect only their own files (a collection of
# the whole suite costs ~11 CPU-s, of one tier's files 3-6), with the same marker expression.
run_tiers() {
    local lane=$1
    shift
    while [[ $# -gt 0 ]]; do
        local name=$1 expression=$2 began=$SECONDS rc=0 paths=() own=() manifest=()
        read -r -a paths <<< "$3"  # the paths hold no spaces
        shift 3
        case "$name" in
            fast) manifest=(GRPO_TEST_TIER_MANIFEST="$results/tier_files") ;;
            ray | vllm | distributed)
                mapfile -t own < <(own_files "$name")
                if [[ ${#own[@]} -gt 0 ]]; then paths=("${own[@]}"); fi ;;
            system-rest)
                mapfile -t own < <(own_files "$name")
                if [[ ${#own[@]} -gt 0 ]]; then paths=("${own[@]}" "${first_lane_ids[@]}"); fi ;;
        esac
        echo "=== tier ${name}: -m \"${expression}\" ${paths[*]}"
        env ${manifest[@]+"${manifest[@]}"} .venv/bin/python -m pytest -m "${expression}" --durations=25 \
            ${paths[@]+"${paths[@]}"} || rc=$?
        echo "=== tier ${name}: exit ${rc} in $((SECONDS - began)) s"
        echo "${name} ${rc} $((SECONDS - began))" >> "$results/tiers.$lane"
    done
}

results=$(mktemp -d)
# One build of the demo's assets for every tier's pytest process (tests/conftest.py, demo_assets).
export GRPO_TEST_SHARED_ASSETS="$results/assets"
trap 'rm -rf "$results"' EXIT
started=$SECONDS
if [[ "${1:-}" == "--fast" ]]; then
    run_tiers main "${tiers[@]:0:3}"
elif [[ "$device" == "cuda" ]]; then
    # On a GPU host the lanes run one after the other: both start vLLM engines, and engines that
    # start on one GPU at once fail vLLM's start-up memory checks at random.
    run_tiers main "${tiers[@]:0:21}" 2>&1
else
    # Two lanes: the system tier's system_lane_files (whole programs on local clusters, the
    # benchmarks' smokes) run beside the other tiers, their output in a log of their own that is
    # printed when both lanes are done. RESULTS.md ("The test suite") has the times.
    logs=runs/test-logs
    mkdir -p "$logs"
    echo "=== lane system: tier system (${system_lane_files[*]}) in the background, its log in $logs/system.log"
    run_tiers system "${tiers[@]:18:3}" > "$logs/system.log" 2>&1 &
    system_lane=$!
    run_tiers main "${tiers[@]:0:18}" 2>&1 | tee "$logs/main.log"
    main_s=$((SECONDS - started))
    wait "$system_lane" || true
    echo "=== lane system (its log, $logs/system.log):"
    cat "$logs/system.log"
    echo "=== lanes: main $main_s s, system $(awk '{s += $3} END {print s}' "$results/tiers.system") s"
fi

failed=()
while read -r name rc seconds; do
    # 5: nothing selected: expected for the gpu tier without CUDA (its tests are deselected).
    if [[ $rc -ne 0 && !( $rc -eq 5 && "$name" == "gpu" && "$device" == "cpu" ) ]]; then
        failed+=("${name} (exit ${rc})")
    fi
    echo "=== tier ${name}: ${seconds} s, exit ${rc}"
done < <(cat "$results"/tiers.*)
echo "=== all tiers: $((SECONDS - started)) s"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED tiers: ${failed[*]}" >&2
    exit 1
fi
