#!/usr/bin/env bash
# Create .venv and install hybridzero with its test extras. Idempotent; safe on a fresh machine.
# torch is installed first, pinned to 2.13.0 (the CPU wheel these machines carry), so that resolving the other
# dependencies never pulls a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e '.[test,plots,tensorboard,lint,data,lora,hf,wandb,comet]'
.venv/bin/python -c 'import torch, transformers, hybridzero; print(f"hybridzero {hybridzero.__version__}: torch {torch.__version__}, transformers {transformers.__version__}")'
