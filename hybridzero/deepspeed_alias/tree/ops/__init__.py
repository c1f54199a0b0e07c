"""``deepspeed.ops`` (a package: ``adam``). ``adagrad`` and ``lion`` (DeepSpeed's CPU Adagrad/Lion) are not
provided: their import fails naming them."""
