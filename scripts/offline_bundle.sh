#!/usr/bin/env bash
# An offline bundle for a machine without network (a cluster GPU node): this repository and the wheels of
# every dependency that machine lacks, with OUT_DIR/run.sh 'COMMAND' to run there. See offline_bundle.py.
#   scripts/offline_bundle.sh OUT_DIR [--python-version X.Y] [--have FREEZE_FILE] [--extras test,bench]
exec "${PYTHON:-python3}" "$(dirname "$0")/offline_bundle.py" "$@"
