"""The embedded demos, on top of the trainers: the run of all three steps on the "reverse the digits" task with its
verdict (:mod:`.run`; the task itself, which the data and model loaders read for the ``"demo"`` special values, is
:mod:`hybridzero.rlhf.data.demo_task`) and the arithmetic GRPO demo (:mod:`.arith_run`, its task :mod:`.arith`,
reward functions :mod:`.rewards`, held-out scoring :mod:`.arith_eval`)."""
