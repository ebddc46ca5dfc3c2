#!/usr/bin/env bash
# Creates (once per requirements file) a Python venv with the pinned OpenAI client for the serve
# tests and benchmark: scripts/serve_venv.sh DIR. Uses python3 from PATH; needs PyPI the first time.
set -euo pipefail
dir=${1:?usage: serve_venv.sh DIR}
req="$(cd "$(dirname "$0")/.." && pwd)/tests/serve/requirements.txt"
stamp="$dir/.requirements"
if [ -x "$dir/bin/python" ] && cmp -s "$req" "$stamp"; then exit 0; fi
rm -rf "$dir"
python3 -m venv "$dir"
"$dir/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req"
"$dir/bin/python" -c "import openai; print('openai', openai.__version__)"
cp "$req" "$stamp"
