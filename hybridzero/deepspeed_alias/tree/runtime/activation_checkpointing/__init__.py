"""``deepspeed.runtime.activation_checkpointing`` (a package: ``checkpointing``)."""
