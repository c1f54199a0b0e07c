"""``deepspeed.runtime`` (a package: ``engine``, ``lr_schedules``, ``zero``)."""
