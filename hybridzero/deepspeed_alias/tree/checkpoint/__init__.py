"""``deepspeed.checkpoint`` (a package: ``utils``)."""
