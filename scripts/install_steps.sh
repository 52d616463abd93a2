# Sourced by scripts/install_cpu.sh and scripts/install_cuda.sh: each install step either succeeds
# quietly or fails the install loudly.
#
#   install_step NAME CMD...  runs CMD with its output held back. On success it prints that output
#                             less pip's known noise (pip_noise_filter); on failure it prints the
#                             output's last INSTALL_TAIL_LINES lines, then "[install] failed: NAME
#                             (exit N)", both on stderr, and returns 1 (set -e ends the install).
#
# INSTALL_REMOVED_ON_PURPOSE (space-separated package names): packages the installer uninstalls on
# purpose; pip's resolver lines saying that a package requires one of them "which is not
# installed" are dropped. Every other ERROR line pip prints is kept.

INSTALL_TAIL_LINES=20

# What pip prints that is known and harmless here: one "WARNING: Location" per package from the
# configured local indexes, and resolver complaints about the packages removed on purpose (the
# resolver's header line too, when every conflict under it was such a complaint).
pip_noise_filter() {
  awk -v removed="${INSTALL_REMOVED_ON_PURPOSE:-}" '
    function norm(name) { name = tolower(name); gsub(/[-_.]+/, "-", name); return name }
    # The held header is printed before the first conflict kept under it, or alone if none followed.
    function release() { if (held && !conflicts && header != "") print header; held = 0; header = "" }
    BEGIN { n = split(removed, names, " "); for (i = 1; i <= n; i++) gone[norm(names[i])] = 1 }
    /^WARNING: Location/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ {
      release(); header = $0; held = 1; conflicts = 0; next
    }
    held && ($3 == "requires" || $3 == "has") {
      conflicts++
      wanted = $4; sub(/[^A-Za-z0-9_.-].*$/, "", wanted)
      if ($3 == "requires" && /, which is not installed\.$/ && norm(wanted) in gone) next
      if (header != "") { print header; header = "" }
      print; next
    }
    { release(); print }
    END { release() }
  '
}

install_step() {
  local name=$1 log rc=0
  shift
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    pip_noise_filter <"$log" | tail -n "$INSTALL_TAIL_LINES" >&2
    rm -f "$log"
    echo "[install] failed: $name (exit $rc); its last lines are above" >&2
    return 1
  fi
  pip_noise_filter <"$log"
  rm -f "$log"
}
