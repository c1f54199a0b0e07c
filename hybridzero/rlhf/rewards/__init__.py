"""Reward sources: reward functions (:mod:`.functions`: loading, calling with a deadline, validating, combining),
their isolation in a forked worker (:mod:`.isolation`) and a run's sources with the agreement protocol
(:mod:`.sources`: functions, then the reward model's score). Above the engines, below the rollout and the steps."""
