#!/usr/bin/env bash
# tools/torch_versions.sh: the torch backend's tests on other torch releases than CI's, each in a
# virtualenv of its own (issue 43: CI runs the newest release of the supported range, this script
# the others, the oldest above all).
#
#   tools/torch_versions.sh                       # from anywhere: VERSIONS="2.10.0" (the oldest supported)
#   VERSIONS="2.10.0 2.14.1" OUT=/tmp/tv tools/torch_versions.sh
#   VERSIONS=2.15.0 PIP_ARGS=--isolated tools/torch_versions.sh   # past a pip constraints file that caps torch
#
# For each version: a venv under ${VENVS:-/tmp/shmproxy-torch-venvs}/torch-<version> (kept: a CUDA
# build of torch from PyPI is several GB; the CPU runs here use it on the CPU), `pip install
# torch==<version>` and this checkout's package with its test extra (a wheel, not editable, so the
# checkout's in-place extensions are not touched), then the torch tests, tests/test_torch_backend.py,
# from the checkout under that venv's Python. Output under ${OUT:-./out}: torch_<version>.log per
# version and torch_versions.txt, one line per version (installed version, passed, failed, skipped).
# Exits non-zero if a version could not be installed or a test failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${OUT:-./out}" && cd "${OUT:-./out}" && pwd)
VENVS=${VENVS:-/tmp/shmproxy-torch-venvs}
VERSIONS=${VERSIONS:-2.10.0}
PY=${PYTHON:-python3}
TESTS=${TESTS:-tests/test_torch_backend.py}
SUMMARY="$OUT/torch_versions.txt"
status=0
: >"$SUMMARY"
for v in $VERSIONS; do
    log="$OUT/torch_$v.log"
    venv="$VENVS/torch-$v"
    echo "=== torch $v: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), venv $venv" | tee "$log"
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv "$venv" >>"$log" 2>&1 || { echo "torch $v: venv failed" | tee -a "$SUMMARY"; status=1; continue; }
    fi
    # PIP_ARGS: e.g. --isolated, past a pip configuration that caps torch (a machine's constraints file)
    # shellcheck disable=SC2086
    if ! "$venv/bin/python" -m pip install ${PIP_ARGS:-} --progress-bar off -q "torch==$v" "$ROOT[test]" >>"$log" 2>&1; then
        echo "torch $v: install failed (see $log)" | tee -a "$SUMMARY"
        status=1
        continue
    fi
    got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>>"$log")
    echo "=== installed torch $got; $TESTS" | tee -a "$log"
    (cd "$ROOT" && timeout 1800 "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS) >>"$log" 2>&1
    rc=$?
    line=$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -1)
    echo "torch $v ($got): ${line:-no result} (pytest exit $rc)" | tee -a "$SUMMARY"
    [ $rc -eq 0 ] || status=1
done
exit $status
