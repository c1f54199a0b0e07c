"""``deepspeed.compression`` (a package: ``helper``)."""
