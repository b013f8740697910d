#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it first if needed.
#   scripts/venv.sh rltjax generate          # the main job
#   scripts/venv.sh python -m pytest -q -n 2 --dist loadfile   # the tests
# The environment lives in .venv (Python 3.12: JAX 0.11 needs it) and is reinstalled
# whenever pyproject.toml changes. Extra pip extras: RLTJAX_EXTRAS (default "test").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${RLTJAX_EXTRAS:-test}"

find_python() {
  local candidates=(python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
  fi
  candidates+=(/usr/bin/python3.12 /usr/local/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12)
  for py in "${candidates[@]}"; do
    if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      echo "$py"; return 0
    fi
  done
  echo "error: Python 3.12 not found (JAX 0.11 needs it); install python3.12 and retry" >&2
  return 1
}

stamp="$venv/.rltjax-installed"
log="$venv/install.log"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)-$extras"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)"
    echo "[venv.sh] creating $venv with $py" >&2
    "$py" -m venv "$venv"
  fi
  # pip's own output goes to a log: shown only when the install fails
  echo "[venv.sh] installing rltjax[$extras] and its dependencies into $venv (a few minutes the first time)" >&2
  # setuptools notes that every editable install of kernels/ and checkpoints/ as rltjax.* (a
  # package-dir mapping, found by an import hook) could be shadowed by same-named folders: not here
  if ! { "$venv/bin/python" -m pip install --upgrade pip && PYTHONWARNINGS="ignore:Editable installation" \
         "$venv/bin/python" -m pip install -e "$root[$extras]"; } > "$log" 2>&1; then
    tail -n 25 "$log" >&2
    echo "error: installing rltjax[$extras] into $venv failed (pip's whole output: $log); fix the cause above" \
         "and run again" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
  echo "[venv.sh] ready" >&2
fi
export PATH="$venv/bin:$PATH"
cd "$root"
exec "$@"
