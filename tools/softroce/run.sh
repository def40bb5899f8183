#!/usr/bin/env bash
# Entry point of the soft-RoCE testbed: run a command inside a QEMU guest with two rxe devices.
#   tools/softroce/run.sh [--repo DIR] [--venv DIR] [--timeout S] -- CMD ...
# See tools/softroce/testbed.py for options and exit statuses. Needs the system python3 only.
set -euo pipefail
exec python3 "$(dirname "$(readlink -f "$0")")/testbed.py" "$@"
