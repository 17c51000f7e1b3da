"""The pipeline's steps as a validated graph: which step feeds which, in what order they can run.

A step's ``needs`` are its inputs, and the kind of each input is constrained by the kind of the step
(a ``tune`` step takes the dataset of one ``stage`` step, ``evaluate`` takes the trials of one
``tune`` or ``train`` step, ...). Those constraints live in one table, ``INPUT_RULES``, from which the
error messages are generated, so the rules and what users are told about them cannot drift apart.

``find_problems`` reports every problem with its YAML path and no line numbers (the loader adds those,
since only it has the file); ``build_dag`` turns a spec without problems into a ``Dag``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tunepod.errors import SpecError, SpecIssue
from tunepod.spec.models import PipelineSpec, StepSpec, folder_problem

YamlPath = tuple[str | int, ...]
"""A position in the spec document: mapping keys and list indices from the top, e.g.
``("steps", "check", "needs", 0)``."""


@dataclass(frozen=True)
class Problem:
    """One problem found in a spec, located by its YAML path (the loader turns it into a ``SpecIssue``)."""

    path: YamlPath
    message: str
    fix: str = ""


@dataclass(frozen=True)
class InputSlot:
    """One input a step kind accepts: one step of any of ``kinds``, required or optional."""

    kinds: tuple[str, ...]
    required: bool = True

    def describe(self) -> str:
        amount = "exactly one" if self.required else "optionally one"
        return f"{amount} {' or '.join(self.kinds)} step"


# The single source of truth for what each step kind may need. Its keys are also the known step kinds
# (a test checks they match the kinds the spec models accept).
INPUT_RULES: dict[str, tuple[InputSlot, ...]] = {
    "stage": (),
    "tune": (InputSlot(("stage",)),),
    "train": (InputSlot(("stage",)), InputSlot(("tune",), required=False)),
    "evaluate": (InputSlot(("tune", "train")),),
    "register": (InputSlot(("evaluate",)),),
    "export": (InputSlot(("tune", "train")),),
}


def describe_inputs(kind: str) -> str:
    """What a step of ``kind`` accepts, in words: ``a train step takes exactly one stage step and ...``."""
    slots = INPUT_RULES[kind]
    if not slots:
        return f"{a_step(kind)} takes no inputs"
    return f"{a_step(kind)} takes " + " and ".join(slot.describe() for slot in slots)


def a_step(kind: str) -> str:
    """``a tune step``, ``an evaluate step``."""
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} step"


def format_path(path: YamlPath) -> str:
    """``("steps", "check", "needs", 0)`` -> ``steps.check.needs[0]``."""
    text = ""
    for segment in path:
        if isinstance(segment, int) and not isinstance(segment, bool):
            text += f"[{segment}]"
        else:
            text += f".{segment}" if text else str(segment)
    return text


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice ``word`` was most likely meant to be, or None when nothing is close."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` when a choice is close to ``word``, else an empty string."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


# ---------------------------------------------------------------------------------------------- checks


def find_problems(spec: PipelineSpec) -> list[Problem]:
    """Every problem in how the steps connect: unknown or repeated needs, cycles, inputs of the wrong kind;
    and step names that cannot name a folder of job dirs (``..``, ``a/b``: see ``folder_problem``).

    Returns all of them (not just the first), each with the YAML path of the offending entry.
    """
    steps = spec.steps
    return [
        *_step_name_problems(steps),
        *_unknown_and_repeated_needs(steps),
        *_cycles(_known_needs(steps)),
        *(problem for name in steps for problem in _input_kind_problems(name, steps)),
    ]


def _step_name_problems(steps: Mapping[str, StepSpec]) -> list[Problem]:
    """A step's name names its jobs' folder (``<root>/jobs/<pipeline>/<step>/``): one plain folder name."""
    problems = []
    for name in steps:
        problem = folder_problem(name)
        if problem is not None:
            fix = "rename the step: any name but '.' or '..', without '/' or '\\'"
            problems.append(Problem(("steps", name), f"step name {problem}", fix))
    return problems


def _known_needs(steps: Mapping[str, StepSpec]) -> dict[str, list[str]]:
    """Each step's needs that name existing steps, without repeats, in the order written."""
    return {name: list(dict.fromkeys(n for n in step.needs if n in steps)) for name, step in steps.items()}


def _unknown_and_repeated_needs(steps: Mapping[str, StepSpec]) -> list[Problem]:
    problems = []
    names = list(steps)
    for name, step in steps.items():
        seen: set[str] = set()
        for index, needed in enumerate(step.needs):
            path = ("steps", name, "needs", index)
            if needed not in steps:
                problems.append(
                    Problem(
                        path,
                        f"unknown step {needed!r}{did_you_mean(needed, names)}",
                        f"needs lists steps of this spec: {', '.join(names)}",
                    )
                )
            elif needed in seen:
                problems.append(
                    Problem(
                        path, f"step {needed!r} is needed twice", f"remove the second {needed!r} from needs"
                    )
                )
            seen.add(needed)
    return problems


def _cycles(needs: Mapping[str, list[str]]) -> list[Problem]:
    """One problem per cycle found, printed in the direction of ``needs``: ``a -> b -> a``."""
    remaining = _unplaceable(needs)
    reported: set[str] = set()
    problems = []
    for start in needs:
        if start not in remaining or start in reported:
            continue
        cycle = _walk_to_cycle(start, needs, remaining)
        if reported.isdisjoint(cycle):
            reported.update(cycle)
            text = " -> ".join([*cycle, cycle[0]])
            problems.append(
                Problem(
                    ("steps", cycle[0], "needs"),
                    f"the steps form a cycle: {text} (each step needs the next)",
                    "remove one of these needs so that every step can run after the steps it needs",
                )
            )
    return problems


def _unplaceable(needs: Mapping[str, list[str]]) -> set[str]:
    """Steps that no topological order can place: those on a cycle and those downstream of one."""
    placed: set[str] = set()
    progress = True
    while progress:
        ready = [name for name in needs if name not in placed and placed.issuperset(needs[name])]
        placed.update(ready)
        progress = bool(ready)
    return set(needs) - placed


def _walk_to_cycle(start: str, needs: Mapping[str, list[str]], remaining: set[str]) -> list[str]:
    # Every unplaceable step needs at least one unplaceable step (maybe itself), so following such needs from
    # ``start`` must come back to a step already visited: the path from there on is a cycle.
    trail: list[str] = []
    current = start
    while current not in trail:
        trail.append(current)
        current = next(n for n in needs[current] if n in remaining)
    return trail[trail.index(current) :]


def _input_kind_problems(name: str, steps: Mapping[str, StepSpec]) -> list[Problem]:
    """Problems with the kinds of the inputs of step ``name``, worded from ``INPUT_RULES``."""
    kind = steps[name].uses
    slots = INPUT_RULES[kind]
    rule = describe_inputs(kind)
    needs = steps[name].needs
    problems = []
    for index, needed in enumerate(needs):
        if needed in steps and not any(steps[needed].uses in slot.kinds for slot in slots):
            problems.append(
                Problem(
                    ("steps", name, "needs", index),
                    f"{needed!r} is {a_step(steps[needed].uses)}, but {rule}",
                    f"remove {needed!r} from the needs of {name!r}",
                )
            )
    for slot in slots:
        matching = list(dict.fromkeys(n for n in needs if n in steps and steps[n].uses in slot.kinds))
        if len(matching) > 1:
            listed = ", ".join(matching)
            message = f"needs {len(matching)} {' or '.join(slot.kinds)} steps ({listed}), but {rule}"
            problems.append(Problem(("steps", name, "needs"), message, f"keep only one of {listed} in needs"))
        elif not matching and slot.required and all(n in steps for n in needs):
            # With an unknown need, that need is reported and may well be the missing input.
            problems.append(
                Problem(("steps", name, "needs"), f"{rule}; none is listed", _add_input_fix(slot, steps))
            )
    return problems


def _add_input_fix(slot: InputSlot, steps: Mapping[str, StepSpec]) -> str:
    candidates = [n for n, step in steps.items() if step.uses in slot.kinds]
    if candidates:
        return f"add one of these steps to needs: {', '.join(candidates)}"
    kinds = " or ".join(slot.kinds)
    return f"add a step with uses: {kinds} and list it in needs"


# ---------------------------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Dag:
    """A spec's steps in dependency order, built by ``build_dag``; read-only, so safe to share across threads.

    ``order`` is topological, ties broken by the order the steps are written in the spec;
    ``levels`` groups the steps that can run at the same time (each level needs only earlier levels).
    """

    steps: Mapping[str, StepSpec]
    order: list[str]
    levels: list[list[str]]
    input_steps: Mapping[str, Mapping[str, str]]

    def kind(self, step: str) -> str:
        """The kind (``uses``) of ``step``."""
        return self.steps[step].uses

    def inputs(self, step: str) -> dict[str, str]:
        """The steps ``step`` takes its inputs from, by kind: ``{"stage": "data", "tune": "search"}``."""
        return dict(self.input_steps[step])

    def to_mermaid(self) -> str:
        """A Mermaid ``flowchart LR``: one node per step labelled ``name<br/>kind``, one edge per need."""
        ids = _mermaid_ids(list(self.steps))
        lines = ["flowchart LR"]
        for name, step in self.steps.items():
            label = f"{name}<br/>{step.uses}".replace('"', "#quot;")
            lines.append(f'    {ids[name]}["{label}"]')
        for name, step in self.steps.items():
            lines.extend(f"    {ids[needed]} --> {ids[name]}" for needed in step.needs)
        return "\n".join(lines) + "\n"


def build_dag(spec: PipelineSpec, source: str = "<spec>") -> Dag:
    """The graph of ``spec``'s steps; raises ``SpecError`` (YAML paths, no lines) if it has problems.

    ``tunepod.spec.load_spec`` runs the same checks with file lines, so a spec it returned always builds.
    """
    problems = find_problems(spec)
    if problems:
        raise SpecError(source, [SpecIssue(format_path(p.path), p.message, p.fix) for p in problems])
    needs = _known_needs(spec.steps)
    levels = _levels(needs)
    return Dag(
        steps=dict(spec.steps),
        order=_order(needs),
        levels=levels,
        input_steps={name: {spec.steps[n].uses: n for n in needs[name]} for name in spec.steps},
    )


def _order(needs: Mapping[str, list[str]]) -> list[str]:
    """Kahn's algorithm; among the steps ready at once, the one written first in the spec goes first."""
    order: list[str] = []
    while len(order) < len(needs):
        order.append(next(n for n in needs if n not in order and set(order).issuperset(needs[n])))
    return order


def _levels(needs: Mapping[str, list[str]]) -> list[list[str]]:
    """Level 0 needs nothing; each other step sits one level after the deepest step it needs."""
    depth: dict[str, int] = {}
    for name in _order(needs):
        depth[name] = 1 + max((depth[n] for n in needs[name]), default=-1)
    return [[n for n in needs if depth[n] == level] for level in range(max(depth.values(), default=-1) + 1)]


def _mermaid_ids(names: list[str]) -> dict[str, str]:
    # Mermaid node ids cannot be quoted, and ``end`` is a keyword there, so any other name gets a
    # positional id (the label still shows the real name).
    ids: dict[str, str] = {}
    for index, name in enumerate(names):
        node_id = name if name.isidentifier() and name.lower() != "end" else f"step{index}"
        while node_id in ids.values() or (node_id != name and node_id in names):
            node_id += "_"
        ids[name] = node_id
    return ids
