"""``deepspeed.runtime.sequence_parallel`` (a package: ``ulysses_sp``, ``parallel_state_sp``)."""
