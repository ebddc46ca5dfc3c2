#!/usr/bin/env bash
# Creates (once per requirements file) a Python venv with the pinned OpenAI client for the serve
# tests and benchmark: scripts/serve_venv.sh DIR. Uses python3 from PATH (or $GLM5_PYTHON); needs
# PyPI the first time. The pins include compiled wheels (pydantic_core, jiter) built per CPython
# version: they install on python3.11, Debian 12's python3.
set -euo pipefail
dir=${1:?usage: serve_venv.sh DIR}
req="$(cd "$(dirname "$0")/.." && pwd)/tests/serve/requirements.txt"
stamp="$dir/.requirements"
if [ -x "$dir/bin/python" ] && cmp -s "$req" "$stamp"; then exit 0; fi
rm -rf "$dir"
py=${GLM5_PYTHON:-python3}
command -v "$py" >/dev/null || { echo "serve_venv.sh: no $py on PATH (install python3, or set GLM5_PYTHON)" >&2; exit 1; }
# Debian splits venv (and the pip it seeds) out of python3: without python3-venv, -m venv fails.
if ! "$py" -m venv "$dir"; then
  rm -rf "$dir"
  ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  echo "serve_venv.sh: '$py -m venv' failed: on Debian/Ubuntu install python3-venv (python$ver-venv)," \
       "e.g. with scripts/setup.sh, or set GLM5_PYTHON to an interpreter with a working venv" >&2
  exit 1
fi
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req"
"$dir/bin/python" -c "import openai; print('openai', openai.__version__)"
cp "$req" "$stamp"
