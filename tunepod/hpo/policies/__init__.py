"""Search policies: what stops a trial's job early and what fills a free slot (``contract``).

``make_policy`` picks the study's: PBT when the spec has ``pbt``, ASHA for ``pruner.kind: asha``,
Optuna's pruner for any other pruner, and none (every trial trains to its end) without one."""

from __future__ import annotations

from tunepod.hpo.policies.asha import AshaPolicy
from tunepod.hpo.policies.contract import PolicyContext, SearchPolicy
from tunepod.hpo.policies.pbt import PbtPolicy
from tunepod.hpo.policies.pruner import OptunaPruning

__all__ = ["PolicyContext", "SearchPolicy", "make_policy"]


def make_policy(ctx: PolicyContext) -> SearchPolicy:
    if ctx.settings.pbt is not None:
        return PbtPolicy(ctx)
    kind = ctx.settings.pruner.kind
    if kind == "asha":
        return AshaPolicy(ctx)
    if kind == "none":
        return SearchPolicy(ctx)
    return OptunaPruning(ctx)
