"""The algorithms' pure math (no engine, no process group): :mod:`.ppo` — the shared conventions, masked statistics,
KL-penalised rewards, GAE and PPO's policy and value losses (with GRPO's original advantage and loss); :mod:`.grpo`
— the GRPO family (Dr. GRPO, DAPO, GSPO, RLOO): group advantages, overlong shaping, the clipped loss, aggregations.
Imports nothing of :mod:`hybridzero.rlhf`'s other rooms."""
