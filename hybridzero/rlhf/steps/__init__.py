"""The three steps, each read top to bottom: supervised fine-tuning (:mod:`.sft`), the reward model
(:mod:`.reward_model`), both on the optimizer-step loop of :mod:`.supervised`; and RL (:mod:`.rl`: PPO and the GRPO
family). Above every other room but the demo and the CLI."""
