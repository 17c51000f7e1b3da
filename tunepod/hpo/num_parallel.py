"""``num_parallel: auto`` made a number, once, as a tune step starts (``Tuner.__init__``), before the
sampler, PBT's population check or the scheduling loop read it: they all see the resolved copy of the
settings (``TuneSettings.with_num_parallel``), never ``auto``.

The number is the launcher's ``trial_slots`` (``tunepod.launch.slots``): what the cluster runs at once
at that moment. It is read again by every start of the step (a rerun, a Prefect retry), and each
orchestrator on one study reads its own; the study-wide cap is the one of the orchestrator asking.
"""

from __future__ import annotations

import logging

from tunepod.errors import TunepodError
from tunepod.launch.base import Launcher
from tunepod.launch.slots import KnowsSlots
from tunepod.spec.models import AUTO, TuneSettings

log = logging.getLogger(__name__)


def resolve_num_parallel(step: str, settings: TuneSettings, launcher: Launcher) -> TuneSettings:
    """``settings`` with ``num_parallel: auto`` replaced by what ``launcher``'s cluster runs at once
    (logged, with why); ``settings`` itself when it holds a number. ``TunepodError`` naming the field
    when the launcher cannot tell, or when the number is too few for PBT's population."""
    if settings.num_parallel != AUTO:
        return settings
    field = f"steps.{step}.with.num_parallel"
    if not isinstance(launcher, KnowsSlots):
        # Refused at spec load already (PipelineSpec); a tuner built by other code gets here.
        raise TunepodError(
            f"{field} is auto, and the {launcher.kind} launcher cannot tell how many trials its cluster "
            f"runs at once; fix: give a number, e.g. --set {field}=4"
        )
    slots = launcher.trial_slots(settings.train.resources)
    log.info("step %s: num_parallel auto: %s", step, slots.why)
    try:
        return settings.with_num_parallel(slots.count)
    except ValueError as exc:
        raise TunepodError(
            f"{field} is auto, which is {slots.count} now ({slots.why}); {exc}, or free more of the "
            "cluster before the step starts"
        ) from None
