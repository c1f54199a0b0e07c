"""The launch lines of DeepSpeed-Chat's 28 training scripts, as data (``training/step{1,2,3}_*/training_scripts``).

Source: microsoft/DeepSpeedExamples, ``applications/DeepSpeed-Chat/training/`` in its current layout (``llama2/``,
``opt/{single_gpu,single_node,multi_node}/``, ``other_language/``; the ``sweep/`` folders hold drivers of a
parameterised ``run_single.sh``, not launch scripts, and are not counted). The index holds upstream's copies of these
paths only at older revisions (some still with step-3 flag names main.py has since renamed, e.g.
``--generation_batch_numbers``), so the text is the fork delock/DeepSpeedExamples@9eea8b6, which holds the whole
current layout at one commit (its launcher lines add ``--bind_cores_to_rank``); ``llama2/run_llama2_7b_mixz.sh``,
absent there, is upstream's @3408d45.

Each line is what the script runs after the shell has expanded it, with only these substitutions: a variable a
script sets from ``$1``..``$5`` with a default (``ZERO_STAGE``, ``ACTOR_ZERO_STAGE``, ...) is that default; learning
rates set in variables (``Actor_Lr``) are their values; ``${OFFLOAD}`` (never set in step 3's
``opt/single_gpu/run_6.7b_lora.sh``) is empty; the model paths a step-3 script takes as arguments stay
``$ACTOR_MODEL_PATH`` / ``$CRITIC_MODEL_PATH``; ``&> $OUTPUT/training.log`` is left off. Model names, ``$OUTPUT``
and the lengths are replaced by the test (:mod:`tests.integration.test_dschat_scripts`), by flag, so the text here
stays the scripts' own.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

__all__ = ["SCRIPTS", "Script", "SHARED_RUNS"]


@dataclass(frozen=True)
class Script:
    """One launch script: its path under ``training/``, the hybridzero step, and its ``deepspeed`` line."""

    path: str
    step: str
    line: str

    def launcher_flags(self) -> list[str]:
        """The ``deepspeed`` launcher's flags (before ``main.py``)."""
        words = shlex.split(self.line)
        return words[1 : words.index("main.py")]

    def main_args(self) -> list[str]:
        """``main.py``'s arguments, split as the shell splits them (quotes removed)."""
        words = shlex.split(self.line)
        return words[words.index("main.py") + 1 :]


_S1 = "step1_supervised_finetuning/training_scripts/"
_S2 = "step2_reward_model_finetuning/training_scripts/"
_S3 = "step3_rlhf_finetuning/training_scripts/"
_EN = "Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets"
_STEP3_HEAD = (
    "--data_path Dahoas/rm-static --data_split 2,4,4 --actor_model_name_or_path $ACTOR_MODEL_PATH "
    "--critic_model_name_or_path $CRITIC_MODEL_PATH --num_padding_at_beginning 1"
)

SCRIPTS: tuple[Script, ...] = (
    # --- step 1 ---------------------------------------------------------------------------------------------------
    Script(
        _S1 + "llama2/run_llama2_7b.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path meta-llama/Llama-2-7b-hf --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0. --num_train_epochs 4 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        "--gradient_checkpointing --zero_stage 3 --deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S1 + "llama2/run_llama2_7b_lora.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path meta-llama/Llama-2-7b-hf --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0. --num_train_epochs 4 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        '--gradient_checkpointing --zero_stage 3 --deepspeed --lora_dim 128 --lora_module_name "layers." '
        "--output_dir $OUTPUT",
    ),
    Script(
        _S1 + "opt/multi_node/run_66b.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-66b --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
        "--max_seq_len 512 --learning_rate 1e-4 --weight_decay 0.1 --num_train_epochs 2 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        "--gradient_checkpointing --zero_stage 3 --lora_dim 128 --lora_module_name decoder.layers. --deepspeed "
        "--output_dir $OUTPUT",
    ),
    Script(
        _S1 + "opt/single_gpu/run_1.3b.sh",
        "sft",
        "deepspeed --num_gpus 1 --bind_cores_to_rank main.py --model_name_or_path facebook/opt-1.3b "
        "--gradient_accumulation_steps 8 --lora_dim 128 --zero_stage 0 --enable_tensorboard --tensorboard_path $OUTPUT "
        "--deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S1 + "opt/single_gpu/run_6.7b_lora.sh",
        "sft",
        f"deepspeed --num_gpus 1 --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-6.7b --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
        "--max_seq_len 512 --learning_rate 1e-3 --weight_decay 0. --num_train_epochs 16 "
        "--gradient_accumulation_steps 16 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        "--gradient_checkpointing --zero_stage 0 --lora_dim 128 --lora_module_name decoder.layers. --deepspeed "
        "--output_dir $OUTPUT_PATH",
    ),
    Script(
        _S1 + "opt/single_node/run_1.3b.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-1.3b --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0. --num_train_epochs 16 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --zero_stage 2 "
        "--deepspeed --enable_tensorboard --tensorboard_path $OUTPUT --output_dir $OUTPUT",
    ),
    Script(
        _S1 + "opt/single_node/run_1.3b_lora.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-1.3b --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
        "--max_seq_len 512 --learning_rate 1e-3 --weight_decay 0.1 --num_train_epochs 16 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --zero_stage 0 "
        "--lora_dim 128 --lora_module_name decoder.layers. --only_optimize_lora --deepspeed --output_dir $OUTPUT_PATH",
    ),
    Script(
        _S1 + "opt/single_node/run_13b.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-13b --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
        "--max_seq_len 512 --learning_rate 1e-4 --weight_decay 0. --num_train_epochs 16 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        "--gradient_checkpointing --zero_stage 3 --lora_dim 128 --lora_module_name decoder.layers. --deepspeed "
        "--output_dir $OUTPUT",
    ),
    Script(
        _S1 + "opt/single_node/run_30b_lora.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-30b --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0. --num_train_epochs 16 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --lora_dim 128 "
        "--gradient_checkpointing --zero_stage 3 --deepspeed --output_dir $OUTPUT_PATH",
    ),
    Script(
        _S1 + "opt/single_node/run_6.7b.sh",
        "sft",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-6.7b --per_device_train_batch_size 6 --per_device_eval_batch_size 6 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0. --num_train_epochs 16 "
        "--gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 "
        "--gradient_checkpointing --zero_stage 3 --deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S1 + "other_language/run_chinese.sh",
        "sft",
        "deepspeed --bind_cores_to_rank main.py --data_path wangrui6/Zhihu-KOL Cohere/miracl-zh-queries-22-12 "
        "Hello-SimpleAI/HC3-Chinese mkqa-Chinese --data_split 10,0,0 --model_name_or_path bigscience/bloom-1b1 "
        "--per_device_train_batch_size 8 --per_device_eval_batch_size 8 --max_seq_len 512 --learning_rate 9.65e-6 "
        "--weight_decay 0. --num_train_epochs 16 --gradient_accumulation_steps 1 --lr_scheduler_type cosine "
        "--num_warmup_steps 0 --seed 1234 --zero_stage 2 --deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S1 + "other_language/run_japanese.sh",
        "sft",
        "deepspeed --bind_cores_to_rank main.py --data_path mkqa-Japanese Cohere/miracl-ja-queries-22-12 "
        "lmqg/qg_jaquad lmqg/qag_jaquad --data_split 10,0,0 --model_name_or_path sberbank-ai/mGPT "
        "--per_device_train_batch_size 8 --per_device_eval_batch_size 8 --max_seq_len 512 --learning_rate 9.65e-6 "
        "--weight_decay 0. --num_train_epochs 16 --gradient_accumulation_steps 1 --lr_scheduler_type cosine "
        "--num_warmup_steps 0 --seed 1234 --zero_stage 2 --deepspeed --output_dir $OUTPUT",
    ),
    # --- step 2 ---------------------------------------------------------------------------------------------------
    Script(
        _S2 + "llama2/run_llama2_7b.sh",
        "reward",
        "deepspeed --bind_cores_to_rank main.py --data_path Dahoas/rm-static --data_split 2,4,4 "
        "--model_name_or_path meta-llama/Llama-2-7b-hf --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0.1 --num_padding_at_beginning 0 "
        "--num_train_epochs 1 --gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 "
        "--seed 1234 --gradient_checkpointing --zero_stage 3 --deepspeed --offload --output_dir $OUTPUT",
    ),
    Script(
        _S2 + "llama2/run_llama2_7b_lora.sh",
        "reward",
        "deepspeed --bind_cores_to_rank main.py --data_path Dahoas/rm-static --data_split 2,4,4 "
        "--model_name_or_path meta-llama/Llama-2-7b-hf --per_device_train_batch_size 8 --per_device_eval_batch_size 8 "
        "--max_seq_len 512 --learning_rate 9.65e-6 --weight_decay 0.1 --num_padding_at_beginning 0 "
        "--num_train_epochs 1 --gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 "
        "--seed 1234 --gradient_checkpointing --zero_stage 3 --deepspeed --offload --lora_dim 128 "
        '--lora_module_name "layers." --output_dir $OUTPUT',
    ),
    Script(
        _S2 + "opt/multi_node/run_350m.sh",
        "reward",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-350m --num_padding_at_beginning 1 --per_device_train_batch_size 2 "
        "--per_device_eval_batch_size 2 --max_seq_len 512 --learning_rate 5e-5 --weight_decay 0.1 --disable_dropout "
        "--num_train_epochs 1 --gradient_accumulation_steps 1 --lr_scheduler_type cosine --num_warmup_steps 0 "
        "--seed 1234 --zero_stage 0 --deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S2 + "opt/single_gpu/run_350m.sh",
        "reward",
        "deepspeed --num_gpus 1 --bind_cores_to_rank main.py --model_name_or_path facebook/opt-350m "
        "--num_padding_at_beginning 1 --weight_decay 0.1 --disable_dropout --gradient_accumulation_steps 4 "
        "--zero_stage 0 --enable_tensorboard --tensorboard_path $OUTPUT --deepspeed --output_dir $OUTPUT",
    ),
    Script(
        _S2 + "opt/single_node/run_350m.sh",
        "reward",
        f"deepspeed --bind_cores_to_rank main.py --data_path {_EN} --data_split 2,4,4 "
        "--model_name_or_path facebook/opt-350m --num_padding_at_beginning 1 --per_device_train_batch_size 4 "
        "--per_device_eval_batch_size 4 --max_seq_len 512 --learning_rate 5e-5 --weight_decay 0.1 "
        "--num_train_epochs 1 --disable_dropout --gradient_accumulation_steps 1 --lr_scheduler_type cosine "
        "--num_warmup_steps 0 --seed 1234 --zero_stage 0 --deepspeed --output_dir $OUTPUT",
    ),
    # --- step 3 ---------------------------------------------------------------------------------------------------
    Script(
        _S3 + "llama2/run_llama2_7b.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 1 --per_device_training_batch_size 1 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--actor_weight_decay 0.1 --critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
        "--gradient_accumulation_steps 1 --actor_gradient_checkpointing --critic_gradient_checkpointing "
        "--offload_reference_model --disable_actor_dropout --num_warmup_steps 100 --deepspeed --seed 1234 "
        "--actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "llama2/run_llama2_7b_lora.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 1 --per_device_training_batch_size 1 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--actor_weight_decay 0.1 --critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
        "--gradient_accumulation_steps 1 --actor_gradient_checkpointing --critic_gradient_checkpointing "
        "--offload_reference_model --disable_actor_dropout --num_warmup_steps 100 --deepspeed --seed 1234 "
        "--actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --actor_lora_dim 64 --critic_lora_dim 64 "
        '--critic_lora_module_name "layers." --actor_lora_module_name "layers." --output_dir $OUTPUT',
    ),
    Script(
        _S3 + "llama2/run_llama2_7b_mixz.sh",
        "ppo",
        f"deepspeed --master_port 12346 main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 1 --per_device_training_batch_size 1 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--actor_weight_decay 0.1 --critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
        "--gradient_accumulation_steps 1 --actor_gradient_checkpointing --critic_gradient_checkpointing "
        "--offload_reference_model --actor_dropout 0.0 --num_warmup_steps 100 --deepspeed --seed 1234 "
        "--actor_zero_stage 3 --critic_zero_stage 3 --enable_mixed_precision_lora --actor_lora_dim 64 "
        '--critic_lora_dim 64 --critic_lora_module_name "layers." --actor_lora_module_name "layers." '
        "--output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/multi_node/run_66b.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 "
        "--actor_weight_decay 0.1 --critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
        "--gradient_accumulation_steps 1 --num_warmup_steps 100 --deepspeed --seed 1234 --enable_hybrid_engine "
        "--inference_tp_size 8 --tp_gather_partition_size 4 --actor_zero_stage 3 --critic_zero_stage 3 "
        "--actor_gradient_checkpointing --disable_actor_dropout --actor_lora_dim 128 "
        "--actor_lora_module_name decoder.layers. --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_gpu/run_1.3b.sh",
        "ppo",
        "deepspeed --num_gpus 1 --bind_cores_to_rank main.py --actor_model_name_or_path $ACTOR_MODEL_PATH "
        "--critic_model_name_or_path $CRITIC_MODEL_PATH --actor_zero_stage 0 --critic_zero_stage 0 "
        "--num_padding_at_beginning 1 --gradient_accumulation_steps 2 --deepspeed --actor_lora_dim 128 "
        "--enable_hybrid_engine --actor_gradient_checkpointing --disable_actor_dropout --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_gpu/run_6.7b_lora.sh",
        "ppo",
        f"deepspeed --num_gpus 1 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 8 --per_device_training_batch_size 8 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 "
        "--num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 16 --num_warmup_steps 100 "
        "--deepspeed --seed 1234 --actor_zero_stage 0 --critic_zero_stage 0 --actor_lora_dim 128 "
        "--actor_gradient_checkpointing --critic_gradient_checkpointing --disable_actor_dropout --enable_hybrid_engine "
        "--output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_node/run_1.3b.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 1 --disable_actor_dropout "
        "--num_warmup_steps 100 --deepspeed --seed 1234 --enable_hybrid_engine --actor_zero_stage 2 "
        "--critic_zero_stage 2 --enable_ema --output_dir $OUTPUT --print_answers --enable_tensorboard "
        "--tensorboard_path $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_node/run_1.3b_lora.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 1 --num_warmup_steps 100 "
        "--deepspeed --seed 1234 --disable_actor_dropout --actor_zero_stage 2 --critic_zero_stage 2 "
        "--actor_lora_dim 128 --enable_hybrid_engine --actor_lora_module_name decoder.layers. --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_node/run_13b.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 16 --per_device_training_batch_size 16 --generation_batches 1 "
        "--ppo_epochs 1 --max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 5e-4 "
        "--critic_learning_rate 5e-6 --num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 1 "
        "--num_warmup_steps 100 --deepspeed --seed 1234 --enable_hybrid_engine --inference_tp_size 2 "
        "--actor_zero_stage 3 --critic_zero_stage 3 --actor_gradient_checkpointing --disable_actor_dropout "
        "--actor_lora_dim 128 --actor_lora_module_name decoder.layers. --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_node/run_30b_lora.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 "
        "--num_train_epochs 1 --lr_scheduler_type cosine --gradient_accumulation_steps 1 "
        "--actor_gradient_checkpointing --disable_actor_dropout --num_warmup_steps 100 --deepspeed --seed 1234 "
        "--actor_zero_stage 3 --critic_zero_stage 3 --actor_lora_dim 128 --enable_hybrid_engine "
        "--actor_lora_module_name decoder.layers. --output_dir $OUTPUT",
    ),
    Script(
        _S3 + "opt/single_node/run_6.7b.sh",
        "ppo",
        f"deepspeed --master_port 12346 --bind_cores_to_rank main.py {_STEP3_HEAD} "
        "--per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 "
        "--max_answer_seq_len 256 --max_prompt_seq_len 256 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 "
        "--actor_weight_decay 0.1 --critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
        "--gradient_accumulation_steps 1 --actor_gradient_checkpointing --disable_actor_dropout --num_warmup_steps 100 "
        "--deepspeed --seed 1234 --enable_hybrid_engine --actor_zero_stage 3 --critic_zero_stage 3 "
        "--output_dir $OUTPUT",
    ),
)

# script -> the script whose world-2 run it shares: the same flags in the same roles, only values differ (model
# name, batch size, epochs, learning rate, weight decay under LoRA, LoRA's module name, which the test points at the
# tiny Llama's blocks for every script), so both take the same code path; tests check the flag sets match
SHARED_RUNS: dict[str, str] = {
    _S1 + "opt/single_node/run_6.7b.sh": _S1 + "llama2/run_llama2_7b.sh",
    _S1 + "opt/multi_node/run_66b.sh": _S1 + "llama2/run_llama2_7b_lora.sh",
    _S1 + "opt/single_node/run_13b.sh": _S1 + "llama2/run_llama2_7b_lora.sh",
    _S1 + "opt/single_node/run_30b_lora.sh": _S1 + "llama2/run_llama2_7b_lora.sh",
    _S2 + "opt/single_node/run_350m.sh": _S2 + "opt/multi_node/run_350m.sh",
}
