"""How a trial ended, in words a person reads in the Prefect UI, the console and the logs.

A pruned, paused or exploited trial is no "Completed" trial: each outcome has its own name (the
Prefect task run's state name) and a line that says at which step and why (its message and log line).
"""

from __future__ import annotations

from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.asha import AshaState, is_paused
from tunepod.hpo.population import ATTR_CONTINUED_IN
from tunepod.outputs import TrialEnding, TrialOutcome, TrialRecord

ENDING_NAMES = {
    "COMPLETE": "Completed",
    "PRUNED": "Pruned",
    "PAUSED": "Paused",
    "EXPLOITED": "Exploited",
    "FAIL": "Failed",
}
"""The name of each ending (``TrialRecord.ending``): a Prefect state name, a console label."""


def ending_of(frozen: FrozenTrial, outcome: TrialOutcome) -> TrialEnding:
    """``outcome`` (``TrialRecord.outcome``), with PBT's exploited trials (PRUNED in Optuna) apart."""
    if outcome == "PRUNED" and frozen.user_attrs.get(ATTR_CONTINUED_IN) is not None:
        return "EXPLOITED"
    return outcome


def why_ended(frozen: FrozenTrial, pruner: str, error: str | None) -> str:
    """Why trial ``frozen`` ended as it did, and at which step; ``pruner`` is the study's pruner kind."""
    step = max(frozen.intermediate_values, default=None)
    at = "" if step is None else f" at step {step}"
    if is_paused(frozen):
        state = AshaState.of(frozen)
        rung = "" if state is None else f" (rung {state.rung})"
        return f"paused{at}{rung} by ASHA: not among the best of its rung yet; it resumes if promoted"
    continued_in = frozen.user_attrs.get(ATTR_CONTINUED_IN)
    if frozen.state is TrialState.PRUNED and continued_in is not None:
        return f"exploited{at} by PBT: its member goes on in trial {continued_in} from a better checkpoint"
    if frozen.state is TrialState.PRUNED:
        if error:
            return f"pruned{at}: {error}"
        value = frozen.intermediate_values.get(step) if step is not None else None
        shown = "" if value is None else f" (value {value:.6g})"
        return f"pruned{at}{shown} by the {pruner} pruner"
    if frozen.state is TrialState.FAIL:
        return f"failed{at}: {(error or 'no reason recorded').splitlines()[0]}"
    if frozen.values is not None:
        return f"completed{at} with {', '.join(f'{v:.6g}' for v in frozen.values)}"
    return f"{frozen.state.name.lower()}{at}"


def ending_line(record: TrialRecord, step: str) -> str:
    """The one line that says how trial ``record`` of tune step ``step`` ended."""
    return f"{step}/trial-{record.number} {ENDING_NAMES[record.ending or record.outcome]}: {record.why}"
