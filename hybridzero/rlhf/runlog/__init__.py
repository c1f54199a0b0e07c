"""Run records: ``metrics.jsonl`` and TensorBoard (:mod:`.metrics`), DeepSpeed-Chat's throughput report
(:mod:`.report`) and PNG curves of a run (:mod:`.plot`). Import nothing of :mod:`hybridzero.rlhf`'s other rooms."""
