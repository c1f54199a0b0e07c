"""Which parameters form which gather group (pure functions of the module tree).

Default plan, generic for any Hugging Face causal LM (nothing is special-cased per architecture):
* the transformer blocks are the children of the largest ``nn.ModuleList`` whose children all share one class (in
  a model without one, of the largest such ``nn.Sequential``; in a model with neither, the largest set of sibling
  submodules of one user-defined class: blocks registered one by one, ``self.layer1 = Block(...)``, …); each block
  is one gather group, gathered around the block's forward;
* every other parameter (embeddings, final norms, heads, projections such as OPT's project_in/out) joins the
  *root* group, gathered for the whole root forward;
* a parameter reachable from more than one block, or from a block and outside it (tied weights), joins the root
  group, so it is gathered whenever any user of it runs; so does one registered as used outside its module
  (``register_external_parameter``, :mod:`hybridzero.zero.external`);
* parameters with ``numel <= persistence_threshold`` (DeepSpeed's rule) stay whole on every rank (the *persistent*
  group);
* a block mixing trainable and frozen parameters becomes two groups with the same owner (see
  :func:`_split_frozen`);
* ZeRO-3 *leaf* modules (:mod:`hybridzero.zero.leaf`) are gathered as one unit: the blocks inside a leaf merge
  into one group owned by the leaf (by the root when the leaf has no ``forward`` of its own, as an
  ``nn.ModuleList``), see :func:`apply_leaves`; a leaf inside a block or outside every block is already whole
  whenever its forward runs.

Invariant: every trainable or frozen parameter of the module is in exactly one group, named by its first name in
``module.named_parameters()``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from torch import nn

from hybridzero.zero.registry import full_numel

ROOT = "root"
PERSISTENT = "persistent"


@dataclass(frozen=True)
class GroupPlan:
    """One gather group: its name, the module whose forward it is gathered around, and its parameters."""

    name: str
    owner: str | None  # qualified module name; "" is the root module; None = never gathered (persistent)
    param_names: tuple[str, ...]

    @property
    def replicated(self) -> bool:
        """True for the persistent group, whose parameters stay whole on every rank."""
        return self.owner is None


def find_blocks(module: nn.Module) -> list[str]:
    """Qualified names of the transformer blocks: the children of the largest homogeneous ``nn.ModuleList`` (every
    Hugging Face decoder), or, in a model with none, of the largest homogeneous ``nn.Sequential`` (``nn.Sequential(
    *blocks)`` stacks, as timm's vision transformers build them), or, with neither, the largest set of sibling
    submodules sharing one class defined outside torch (:func:`_largest_sibling_set`). Empty when there is none:
    everything is then in the root group."""
    for kind in (nn.ModuleList, nn.Sequential):
        found = _largest_homogeneous(module, kind)
        if found:
            return found
    return _largest_sibling_set(module)


def _largest_sibling_set(module: nn.Module) -> list[str]:
    """Blocks registered one by one (``self.layer1 = Block(); self.layer2 = Block()``): among the children of each
    submodule, the ones of one class defined outside torch (torch's own layers, ``fc1``/``fc2`` ``nn.Linear``, stay in
    their parent's group), with a ``forward`` of their own and parameters, when there are at least two; the set
    holding the most parameter elements wins (the first of equals). Each is then gathered around its own forward,
    as DeepSpeed fetches every submodule. Empty if there is no such set."""
    best: tuple[int, list[str]] | None = None
    for name, sub in module.named_modules():
        by_class: dict[type[nn.Module], list[tuple[str, nn.Module]]] = {}
        for child_name, child in sub.named_children():
            by_class.setdefault(type(child), []).append((child_name, child))
        for cls, children in by_class.items():
            if len(children) < 2 or cls.__module__.split(".")[0] == "torch" or cls.forward is nn.Module.forward:
                continue
            size = sum(full_numel(p) for _, child in children for p in child.parameters())
            if all(any(True for _ in child.parameters()) for _, child in children) and (best is None or size > best[0]):
                best = (size, [f"{name}.{c}" if name else c for c, _ in children])
    return [] if best is None else best[1]


def _largest_homogeneous(module: nn.Module, kind: type[nn.Module]) -> list[str]:
    """The children's names of the ``kind`` container whose children all share one class and which holds the most
    parameter elements (the first of equals); empty if none holds any."""
    best: tuple[int, str, nn.Module] | None = None
    for name, sub in module.named_modules():
        if not isinstance(sub, kind) or len(list(sub.children())) == 0:
            continue
        if len({type(child) for child in sub.children()}) != 1:
            continue
        size = sum(full_numel(p) for p in sub.parameters())
        if size > 0 and (best is None or size > best[0]):
            best = (size, name, sub)
    if best is None:
        return []
    _, prefix, blocks = best
    return [f"{prefix}.{child}" if prefix else child for child, _ in blocks.named_children()]


def _owner_of(param_names: Sequence[str], blocks: Sequence[str]) -> str:
    owners = set()
    for pname in param_names:
        owner = ""
        for block in blocks:
            if pname.startswith(block + "."):
                owner = block
                break
        owners.add(owner)
    return owners.pop() if len(owners) == 1 else ""


def param_aliases(module: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter (tied weights have several), keyed by its first name, in registration order.

    The one place alias lists are computed: gather groups, checkpoints and HF loading all use it."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _split_frozen(block: str, names: Sequence[str], trainable: dict[str, bool]) -> list[GroupPlan]:
    """A block's group, or two when it mixes trainable and frozen parameters (LoRA: adapters beside a frozen base):
    the trainable one (named after the block) is then sharded evenly over the ranks, so its gradient and optimizer
    bytes are too, and the frozen one (``<block>:frozen``) can be gathered quantized
    (``zero_quantized_nontrainable_weights``). Both are gathered around the block's forward."""
    if not names:
        return []
    train = tuple(n for n in names if trainable[n])
    frozen = tuple(n for n in names if not trainable[n])
    if not train or not frozen:
        return [GroupPlan(block, block, tuple(names))]
    return [GroupPlan(block, block, train), GroupPlan(f"{block}:frozen", block, frozen)]


def _within(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def apply_leaves(module: nn.Module, blocks: Sequence[str], leaves: Sequence[str]) -> list[str]:
    """The gather-group owners once ``leaves`` (qualified names, none inside another) are gathered as units: each
    block inside a leaf is replaced by the leaf (in the place of its first block), or dropped into the root group
    when the leaf has no ``forward`` of its own (a container such as ``nn.ModuleList``, whose forward never runs)
    or is the root itself. Pure."""
    out: list[str] = []
    for block in blocks:
        leaf = next((lf for lf in leaves if _within(block, lf)), None)
        if leaf is None:
            out.append(block)
        elif leaf and leaf not in out and type(module.get_submodule(leaf)).forward is not nn.Module.forward:
            out.append(leaf)
    return out


def plan_groups(
    module: nn.Module,
    persistence_threshold: int,
    blocks: Sequence[str] | None = None,
    leaves: Sequence[str] = (),
    external: Collection[str] = (),
) -> list[GroupPlan]:
    """Gather groups for ``module``: root first, then blocks in order, then the persistent group (if any).

    Empty groups are omitted. ``blocks`` overrides :func:`find_blocks`; ``leaves`` are the ZeRO-3 leaf modules
    (:func:`apply_leaves`); ``external`` names parameters registered as used outside their module
    (:mod:`hybridzero.zero.external`): they join the root group (or the persistent one, if small enough).
    """
    block_names = apply_leaves(module, list(find_blocks(module) if blocks is None else blocks), leaves)
    by_first = param_aliases(module)
    aliases = {id(module.get_parameter(first)): names for first, names in by_first.items()}
    canonical = {pid: names[0] for pid, names in aliases.items()}
    members: dict[str, list[str]] = {"": [], **{b: [] for b in block_names}}
    persistent: list[str] = []
    sizes = {name: full_numel(p) for name, p in module.named_parameters()}
    trainable = {name: p.requires_grad for name, p in module.named_parameters()}
    for pid, first in canonical.items():
        if sizes[first] <= persistence_threshold:  # DeepSpeed's rule (mark_persistent_parameters)
            persistent.append(first)
        elif first in external:
            members[""].append(first)
        else:
            members[_owner_of(aliases[pid], block_names)].append(first)
    plans = [GroupPlan(ROOT, "", tuple(members[""]))] if members[""] else []
    for b in block_names:
        plans += _split_frozen(b, members[b], trainable)
    if persistent:
        plans.append(GroupPlan(PERSISTENT, None, tuple(persistent)))
    return plans
