"""Kiln's Inductor heuristics: Inductor's own (`InductorChoices`), with wider persistent reductions.

Inductor makes an inner reduction over more than 1,024 elements a looped one: two passes over the row (the
sum of squares, then the scaling) where one would do. The models' RMSNorms (hidden 2,048-4,096) are such rows,
33-65 of them a step, and at batch 1 the persistent kernel is a quarter faster.

A module of its own, imported at the first compile (importing Inductor's heuristics costs ~2 s, which a warm
start does without), and a class at module level: Inductor pickles it into its cache key.
"""

from __future__ import annotations

from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V

PERSISTENT_REDUCTION_MAX = 4096


class KilnChoices(InductorChoices):
    """Inner reductions up to PERSISTENT_REDUCTION_MAX elements persistent; the rest as Inductor decides."""

    def uuid(self) -> str:  # for Inductor's own cache key (its `inductor_choices_class` setting)
        return f"kiln-persistent-reductions-{PERSISTENT_REDUCTION_MAX}"

    @staticmethod
    def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs):
            return True
        if cooperative_reduction or not inductor_config.triton.persistent_reductions:
            return False
        if features.get_reduction_hint() != ReductionHint.INNER:
            return False
        return V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_REDUCTION_MAX)
