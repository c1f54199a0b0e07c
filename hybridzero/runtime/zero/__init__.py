"""``hybridzero.runtime.zero``: the ``deepspeed.runtime.zero`` module names user code imports (the ZeRO machinery
itself lives in :mod:`hybridzero.zero`)."""
