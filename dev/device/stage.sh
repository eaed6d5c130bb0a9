#!/usr/bin/env bash
# On the GPU machine: keep one carried folder's files for the install (they survive while the machine is warm).
set -euo pipefail
mkdir -p /tmp/qstage
cp -a "${1:?usage: stage.sh CARRIED_DIR}"/. /tmp/qstage/
ls /tmp/qstage | tr '\n' ' '; echo
