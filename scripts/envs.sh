# Sourced by scripts/test.sh: the two other environments installed where the disk holds them.
# GiB of free disk each needs while pip installs it: its wheels beside their unpacked files, and 1 GiB
# to spare (measured with pip 23 and --no-cache-dir, 2026-12-06: torch 2.11.0 peaks at 6.2 GiB and
# keeps 4.6; torch 2.15.0 peaks at 7.7 and keeps 5.3, the whole .venv-timm 5.7). pip's temporary
# files go on the same disk (.ci-logs/tmp), so that the disk measured is the disk filled.
declare -A needs=([.venv-torch211]=8 [.venv-timm]=9)
declare -A setups=([.venv-torch211]=scripts/setup_torch211.sh [.venv-timm]=scripts/setup_timm.sh)
free_kib() { df -Pk . | awk 'NR==2 {print $4}'; }
gib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1048576}'; }
ready() { [ -e ".ci-logs/ready$1" ]; }  # installed, or brought up to date, by this run

# set_up ENV: installs ENV or brings it up to date, where the disk allows. Ready: .ci-logs/readyENV.
# For want of disk (before, or pip's "No space left on device"): .ci-logs/nospaceENV, and the
# environment is removed (what pip left of it is of no use). Any other failure: the environment is left as it is and .ci-logs/broken says so
# (the run fails).
set_up() {
  rm -f ".ci-logs/ready$1" ".ci-logs/nospace$1"
  if [ ! -x "$1/bin/python" ] && [ "$(free_kib)" -lt $((needs[$1] * 1048576)) ]; then
    echo "$1 not installed: $(gib "$(free_kib)") GiB free, its install needs about ${needs[$1]}"
    touch ".ci-logs/nospace$1"
    return 1
  fi
  mkdir -p .ci-logs/tmp
  if TMPDIR="$PWD/.ci-logs/tmp" bash "${setups[$1]}" > ".ci-logs/$1.log" 2>&1; then
    cat ".ci-logs/$1.log"
    touch ".ci-logs/ready$1"
    return 0
  fi
  cat ".ci-logs/$1.log"
  if grep -q "No space left on device" ".ci-logs/$1.log"; then
    rm -rf "$1"
    echo "$1 did not fit on the disk ($(gib "$(free_kib)") GiB free once removed)"
    touch ".ci-logs/nospace$1"
  else
    echo "$1 failed to install (not for want of disk)" | tee -a .ci-logs/broken
  fi
  return 1
}

# room_by_removing ENV OTHER: whether removing OTHER gives ENV the disk its install needs
room_by_removing() {
  [ -d "$2" ] && [ $(($(free_kib) + $(du -sk "$2" | cut -f1))) -ge $((needs[$1] * 1048576)) ]
}
