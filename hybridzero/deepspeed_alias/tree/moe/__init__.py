"""``deepspeed.moe`` (a package: ``layer``, ``utils``): DeepSpeed's expert-parallel MoE layer is not provided (MoE
models from Transformers train as any model; their experts can be ZeRO-3 leaf modules, ``deepspeed.utils.
set_z3_leaf_modules``)."""
