"""The embedded demo: the "reverse the digits" task (:mod:`.task`, a leaf: vocabulary, tokenizer, tiny model
config, data files and the hidden rule, which the data and model loaders read for the ``"demo"`` special values)
and the run of all three steps with its verdict (:mod:`.run`, on top of the trainers). Nothing is imported here
so that loading :mod:`.task` never pulls in the trainers."""
