"""``deepspeed.launcher`` (a package: ``runner``'s constants only; launch with torchrun or ``hybridzero launch``)."""
