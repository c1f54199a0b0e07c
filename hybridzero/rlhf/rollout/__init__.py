"""Rollouts: generation with per-sample seeded sampling and scoring by every role (:mod:`.generate`), the typed
experience record (:mod:`.experience`) and stop strings (:mod:`.stops`). Above the algorithms' math, the engines and
the rewards; below the steps."""
