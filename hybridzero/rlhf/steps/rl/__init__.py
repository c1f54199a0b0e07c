"""Step 3, reinforcement learning: the outer loop (:mod:`.trainer`), what both algorithms share on a rank
(:mod:`.step3`), one iteration of PPO (:mod:`.ppo`) and of the GRPO family (:mod:`.grpo`, its scored groups and
DAPO's refill in :mod:`.grpo_rollout`), and multi-role checkpoints (:mod:`.checkpoints`)."""
