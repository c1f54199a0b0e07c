"""``hybridzero.ops``: DeepSpeed's ``deepspeed.ops`` names that user code imports (``ops.adam``); no compiled ops."""
