"""``hybridzero plan``: what a run will cost on a cluster we do not have -- memory per rank, bytes per collective
and link, step time -- computed by the engine's own layout and gather rules on a meta-device model.

Layering: this package sits above ``runtime`` (it reads ``config``, ``comm``, ``zero`` and ``optim``); nothing below
imports it. Pure functions: :mod:`.layout` (the engine's groups), :mod:`.memory` (model states, activations, KV
cache), :mod:`.steps` (the predicted ledger), :mod:`.roofline` (step time), :mod:`.search` (configurations ranked);
:mod:`.profiles` and :mod:`.model` read the data files; :mod:`.planner` assembles a plan, :mod:`.report` prints it.
"""
