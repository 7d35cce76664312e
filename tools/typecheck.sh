#!/usr/bin/env bash
# mypy over the package as it is imported: `shmproxy`, whose modules live in three folders (proxy/ is
# the package itself, shm/ and transports/ are shmproxy.shm and shmproxy.transports; pyproject.toml).
# Run on the folders, mypy would call them `proxy`, `shm` and `transports`, find no `shmproxy` behind
# the package's own imports and, with ignore_missing_imports, type every one of them as Any: nothing
# across modules would be checked. So this builds the import tree from symlinks in a temporary
# directory, checks it with setup.cfg's [mypy] settings, and prints paths of the checkout.
# Usage: tools/typecheck.sh [mypy options]   (exit status: mypy's)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TREE=$(mktemp -d "${TMPDIR:-/tmp}/shmproxy-typecheck.XXXXXX")
trap 'rm -rf "$TREE"' EXIT

mkdir "$TREE/shmproxy"
for entry in "$ROOT"/proxy/*; do
    case "$(basename "$entry")" in __pycache__) continue ;; esac
    ln -s "$entry" "$TREE/shmproxy/$(basename "$entry")"
done
ln -s "$ROOT/shm" "$TREE/shmproxy/shm"
ln -s "$ROOT/transports" "$TREE/shmproxy/transports"

cd "$TREE"
set +e
"$PY" -m mypy --config-file "$ROOT/setup.cfg" --cache-dir "$TREE/.mypy_cache" "$@" shmproxy > "$TREE/out.txt" 2>&1
rc=$?
set -e
sed -e 's#^shmproxy/shm/#shm/#' -e 's#^shmproxy/transports/#transports/#' -e 's#^shmproxy/#proxy/#' "$TREE/out.txt"
exit $rc
