# What scripts/gpu_check.sh does with each part's outcome, sourced by it and kept apart so that a
# test runs the same functions without a GPU (tests/system/test_the_gpu_check.py):
#   summary=FILE; source scripts/gpu_check_parts.sh
#   part NAME LIMIT_S LOG COMMAND...   one part under a time limit: its outcome, one line in FILE
#   failed_rows NAME TABLE_MD          the failed rows of a part's markdown table, listed in FILE
#   finish                             the verdict, last in FILE; returns 1 when a part or row failed
# A part whose output ends with a line holding ': not run: WHY' ran only in part: WHY goes into the
# verdict (`gpu_check: ... not run: WHY`), which is not a failure on its own.

gpu_check_failed=()   # parts and rows that failed
gpu_check_not_run=()  # what a part said it did not run, and why
gpu_check_parts=0

_gpu_check_last_line() {  # _gpu_check_last_line LOG: the last non-blank line
    grep -v '^\s*$' "$1" | tail -1
}

part() {  # part NAME LIMIT_S LOG COMMAND...
    local name=$1 limit=$2 log=$3
    shift 3
    local began=$SECONDS rc=0
    timeout "$limit" "$@" > "$log" 2>&1 || rc=$?
    local took=$((SECONDS - began)) state="ok" last
    last=$(_gpu_check_last_line "$log")
    if [[ $rc -eq 124 ]]; then state="timed out after ${limit} s"; elif [[ $rc -ne 0 ]]; then state="failed (exit $rc)"; fi
    gpu_check_parts=$((gpu_check_parts + 1))
    [[ $state == ok ]] || gpu_check_failed+=("$name")
    if [[ $last == *": not run: "* ]]; then
        gpu_check_not_run+=("${last#*: not run: }")
        [[ $state != ok ]] || state="ran in part"
    fi
    echo "- $name: $state in ${took} s; last line: ${last:0:300}" >> "$summary"
}

failed_rows() {  # failed_rows NAME TABLE_MD: rows whose status column (the third) starts with 'failed'
    local name=$1 table=$2 row
    [[ -f $table ]] || return 0
    while IFS= read -r row; do
        echo "  - failed row: $row" >> "$summary"
        gpu_check_failed+=("$name row '${row%%: failed*}'")
    done < <(awk -F'|' 'NF >= 5 && $4 ~ /^ *failed/ {
        gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $4); print $2 ": " $4 }' "$table")
}

_gpu_check_join() {  # _gpu_check_join ITEM...: the items joined by ', '
    local IFS=$'\x1f' joined
    joined="$*"
    echo "${joined//$'\x1f'/, }"
}

finish() {  # the verdict line, last in the summary; returns 1 when anything failed
    local verdict
    if ((${#gpu_check_failed[@]})); then
        verdict="FAILED: $(_gpu_check_join "${gpu_check_failed[@]}")"
    else
        verdict="ok: ${gpu_check_parts} parts, none failed"
    fi
    if ((${#gpu_check_not_run[@]})); then
        verdict+="; not run: $(_gpu_check_join "${gpu_check_not_run[@]}")"
    fi
    echo >> "$summary"
    echo "gpu_check: $verdict" >> "$summary"
    ((${#gpu_check_failed[@]} == 0))
}
