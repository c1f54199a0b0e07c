"""``deepspeed.runtime.fp16`` (a package: ``fused_optimizer``, ``unfused_optimizer``, ``loss_scaler``)."""
