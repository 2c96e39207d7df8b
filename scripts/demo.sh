#!/usr/bin/env bash
# The main job: bring rxe up (natively or in a QEMU guest) and run the echo server and
# client over it, printing round-trip times.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/aiodat rxe run --timeout 900 -- .venv/bin/python examples/demo.py "$@"
