"""Model families: what a recipe's `model.family` names. Each implements `ModelFamily`
(recipe fields and checks, parameter and FLOP formulas, meta-device build, tensor-parallel plan,
pipeline layer split). Importing this package loads no torch.

Public surface: `ModelFamily`, `get_family(name)`, `family_of(model_spec)`, `FAMILY_NAMES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tuner.models import gpt as _gpt  # noqa: F401 - registers the family
from tuner.models import hf as _hf  # noqa: F401 - registers the family
from tuner.models import llama as _llama  # noqa: F401 - registers the family
from tuner.models import plugins as _plugins  # noqa: F401 - registers `plugin`
from tuner.models.base import _REGISTRY, ModelFamily, get_family

if TYPE_CHECKING:
    from tuner.recipe import ModelSpec

FAMILY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def family_of(m: ModelSpec) -> ModelFamily:
    """The family of a recipe's model section (for `plugin`, the installed plugin it names)."""
    if m.family == "plugin":
        return _plugins.load_plugin(m.plugin)
    return get_family(m.family)


__all__ = ["FAMILY_NAMES", "ModelFamily", "family_of", "get_family"]
