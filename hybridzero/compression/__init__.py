"""``hybridzero.compression``: the ``deepspeed.compression`` helpers user code imports (no compression methods)."""
