"""The model families by `model.arch`, as the config sees them: what a family answers before
launch (its shape rules, its tensor-parallel rule, its FP8 linears), so that nothing in
`megalite.config` names a family. A family registers once (`register_family`): GPT-2's and
Llama's in `megalite.model.families`, which `megalite/__init__.py` has imported when a family
is first asked for (`builtin_families_from`); a family of
one's own registers the same way (tests/integration/model/test_third_family.py does)."""
from __future__ import annotations

from typing import Callable, Dict, List, Protocol, Tuple

from megalite.config.errors import fail

# (layer, key of its input dimension, local input size, key of its output dimension, local
# output size): one FP8 linear of a block, one TP rank's weight
Fp8Linear = Tuple[str, str, int, str, int]


class FamilyRules(Protocol):
    """What `megalite.config` asks of a family (`megalite.model.family.Family` supplies it)."""

    name: str  # its model.arch
    mixture_of_experts: bool  # its blocks have MoE layers (model.moe.num_experts >= 1)
    # weights every TP rank holds whole but uses on its own heads only (Qwen3's q/k norms):
    # their gradients are partial sums, summed over TP with the sequence-parallel norms' (sp)
    tp_partial_weights: bool
    own_head_dim: bool  # model.head_dim may set the heads' size apart from n_embd / n_head

    def check(self, cfg) -> None:
        """The rules of a `ModelConfig` of this family beyond the shared ones (ConfigError)."""

    def check_tp(self, cfg, tp: int) -> None:
        """The rules between the model's shape and `tp` beyond heads, hidden and MLP size."""

    def fp8_linears(self, cfg, tp: int) -> List[Fp8Linear]:
        """The block's FP8 linears (`Fp8Linear`) at `tp`."""


_FAMILIES: Dict[str, FamilyRules] = {}
_BUILTIN: List[Callable[[], None]] = []  # what registers the built-in families, until it ran


def builtin_families_from(load: Callable[[], None]) -> None:
    """`load()` registers the built-in families (`megalite/__init__.py` passes the import
    of `megalite.model.families`): run when a family is first asked for, so that a command
    that asks for none (a `--help`, a refusal before the model) does not import the models
    and torch."""
    _BUILTIN[:] = [load]


def _load_builtin() -> None:
    while _BUILTIN:
        _BUILTIN.pop()()


def register_family(family: FamilyRules) -> FamilyRules:
    """Make `family` the one of `model.arch=family.name`; a second family of that name is
    refused (a family registers once)."""
    known = _FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise ValueError(f"model.arch={family.name!r} is registered already ({known!r})")
    _FAMILIES[family.name] = family
    return family


def arch_names() -> Tuple[str, ...]:
    """The registered families' names, in registration order."""
    _load_builtin()
    return tuple(_FAMILIES)


def registered_family(arch: str) -> FamilyRules:
    """The family of `model.arch=arch`; a ConfigError naming the registered ones otherwise."""
    _load_builtin()
    if arch not in _FAMILIES:
        fail("model.arch", arch, f"use one of {', '.join(_FAMILIES)}")
    return _FAMILIES[arch]
