from hybridzero.zero.init import Init as Init  # DeepSpeed: deepspeed.zero.Init
