#!/usr/bin/env bash
# Bytes a device call may carry beside the working tree (docs/FA4.md, "GPU commands"): 64 MiB less
# the tree (tracked and untracked-not-ignored files) counted in whole 4 KiB blocks per file as the
# device tool counts it (a call of 66.7 MB in bytes, 67.7 MB in blocks, was refused), less 1 MiB
# for the tree's growth by a session's edits. Used by the scripts that split big files over calls.
#   bash tools/device_room.sh          # prints the bytes
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
  awk '{s += int(($1 + 4095) / 4096) * 4096} END {print s + 0}')
echo $(( 64 * 1024 * 1024 - tree - 1024 * 1024 ))
