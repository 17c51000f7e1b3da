"""Loading a spec: every kind of mistake is reported with the file, the line, the YAML path and a fix.

Each broken spec is the valid fixture with one edit, so the expected line is found by looking for the
edited text in the file the loader read (an assertion on the exact line, not on "some line").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tunepod.errors import SpecError, SpecIssue
from tunepod.spec import OverrideIssue, PipelineSpec, dump_spec, load_spec, parse_spec, spec_hash
from tunepod.spec.loader import _parse_override

REPO = Path(__file__).resolve().parents[2]
VALID_PATH = REPO / "tests/fixtures/specs/valid.yaml"
VALID = VALID_PATH.read_text()


@dataclass(frozen=True)
class Case:
    id: str
    old: str  # text of the valid spec to replace ...
    new: str  # ... with this
    path: str  # the YAML path the issue must name
    message: str  # a part of the issue's message
    fix: str  # a part of the issue's fix
    line_of: str = ""  # the issue's line is the line holding this text (default: the first line of `new`)


CASES = [
    # --- what the models reject
    Case(
        "wrong type",
        "num_trials: 16",
        "num_trials: ten",
        "steps.search.with.num_trials",
        "expected an integer, got 'ten'",
        "set num_trials to an integer (Finished trials the study should hold",
    ),
    Case(
        "unknown key, close to a valid one",
        "num_parallel: 2",
        "num_paralel: 2",
        "steps.search.with.num_paralel",
        "unknown key 'num_paralel'; valid keys here: train, study, space, num_trials, num_parallel",
        "did you mean 'num_parallel'?",
    ),
    Case(
        "unknown key under the launcher (no discriminator tag in the path)",
        "launcher: {kind: local}",
        "launcher: {kind: local, bogus: 1}",
        "launcher.bogus",
        "valid keys here: kind, root, cancel_grace_s",
        "remove it",
    ),
    Case(
        "unknown key in a step's with (no step-kind tag in the path)",
        "with: {source: builtin://digits,",
        "with: {sorce: x, source: builtin://digits,",
        "steps.data.with.sorce",
        "unknown key 'sorce'",
        "did you mean 'source'?",
    ),
    Case(
        "missing field, at its parent's line",
        "tracking: {uri: sqlite:///.tunepod/mlflow.db, experiment: digits}",
        "tracking: {uri: sqlite:///.tunepod/mlflow.db}",
        "tracking.experiment",
        "missing required key 'experiment' (MLflow experiment that holds the pipeline runs.)",
        "add experiment: under tracking",
    ),
    Case(
        "unknown step kind",
        "uses: tune",
        "uses: tuen",
        "steps.search.uses",
        "unknown step kind 'tuen'",
        "use one of: stage, tune, train, evaluate, register, export (did you mean 'tune'?)",
    ),
    Case(
        "step without uses",
        "    uses: register\n",
        "",
        "steps.promote.uses",
        "missing 'uses', the step kind",
        "add uses: one of stage, tune, train, evaluate, register, export",
        line_of="  promote:",
    ),
    Case(
        "unknown launcher kind",
        "launcher: {kind: local}",
        "launcher: {kind: slurmm}",
        "launcher.kind",
        "unknown launcher kind 'slurmm'",
        "use one of: local",
    ),
    Case(
        "a variable both inline and from a Secret (HyperPod EKS)",
        "launcher: {kind: local}",
        "launcher: {kind: hyperpod_eks, image: i, root: /fsx, claim_name: c, env: {HF_TOKEN: hf_x}, "
        "secret_env: {HF_TOKEN: {secret: hugging-face, key: token}}}",
        "launcher",
        "HF_TOKEN set in both env and secret_env",
        "remove HF_TOKEN from env (secret_env reads the value from its Secret",
    ),
    Case(
        "unknown search parameter type",
        "hidden: {type: int,",
        "hidden: {type: integer,",
        "steps.search.with.space.hidden.type",
        "unknown search parameter type 'integer'",
        "use one of: float, int, categorical (did you mean 'int'?)",
    ),
    Case(
        "bad literal",
        "direction: maximize",
        "direction: max",
        "steps.search.with.study.direction",
        "'max' is not one of: maximize, minimize",
        "use one of: maximize, minimize",
    ),
    Case(
        "a study without an objective",
        "direction: maximize, metric: val_accuracy}",
        "direction: maximize}",
        "steps.search.with.study",
        "the study has no objective",
        "set metric (and direction), or objectives: [{metric: ..., direction: ...}, ...]",
    ),
    Case(
        "one objective and several at once",
        "direction: maximize, metric: val_accuracy}",
        "direction: maximize, metric: val_accuracy, objectives: [{metric: loss, direction: minimize}]}",
        "steps.search.with.study",
        "set either metric/direction (one objective) or objectives (several), not both",
        "remove direction and metric (objectives[0] is the primary objective)",
    ),
    Case(
        "an objective listed twice",
        "direction: maximize, metric: val_accuracy}",
        "objectives: [{metric: loss, direction: minimize}, {metric: loss, direction: maximize}]}",
        "steps.search.with.study",
        "objectives name loss more than once",
        "list each metric once",
    ),
    Case(
        "a pruner on a multi-objective study",
        "direction: maximize, metric: val_accuracy}",
        "objectives: [{metric: val_accuracy, direction: maximize}, {metric: cost, direction: minimize}]}",
        "steps.search.with.pruner",
        "pruner.kind hyperband cannot prune a study with 2 objectives",
        "set pruner: {kind: none}, or keep one objective",
        line_of="pruner: {kind: hyperband",
    ),
    Case(
        "model validator: its message carries the fix",
        "lr: {type: float, low: 1.0e-4, high: 1.0e-1, log: true}",
        "lr: {type: float, low: 1.0e-1, high: 1.0e-4, log: true}",
        "steps.search.with.space.lr",
        "bounds inverted: low=0.1 > high=0.0001",
        "swap low and high",
    ),
    Case(
        "bound",
        "num_parallel: 2",
        "num_parallel: 0",
        "steps.search.with.num_parallel",
        "must be greater than or equal to 1, got 0",
        "set num_parallel to 1 or more",
    ),
    Case(
        "value of none of a union's types",
        "choices: [adam, sgd]",
        "choices: [adam, {sgd: 1}]",
        "steps.search.with.space.optimizer.choices[1]",
        "expected a string, an integer, a number, true/false or null, got a mapping",
        "change it to a string",
    ),
    Case(
        "key YAML reads as a boolean",
        "  data:\n",
        "  on:\n",
        "steps.True",
        "the key true is not a string",
        "quote the key",
    ),
    Case(
        "key written twice",
        "  promote:\n",
        "  check:  # again\n    uses: stage\n    with: {source: a, target: b}\n  promote:\n",
        "steps.check",
        "key 'check' appears twice",
        "remove or rename one of them",
    ),
    Case(
        "pattern",
        "name: digits-hpo",
        "name: digits hpo",
        "name",
        "must match pattern '^[A-Za-z0-9_.-]+$', got 'digits hpo'",
        "change name to match",
    ),
    # --- names that would put job dirs outside <root>/jobs/<name>/ (they become folders there)
    Case(
        "pipeline name '..'",
        "name: digits-hpo",
        "name: '..'",
        "name",
        "'..' cannot name a folder of job dirs: it would not be one folder under <root>/jobs",
        "use only letters, digits, '_', '-' and '.', and not '.' or '..' alone",
    ),
    Case(
        "study name '.'",
        "study: {name: digits,",
        "study: {name: '.',",
        "steps.search.with.study.name",
        "'.' cannot name a folder of job dirs: it would not be one folder under <root>/jobs",
        "use only letters, digits, '_', '-' and '.', and not '.' or '..' alone",
    ),
    Case(
        "step name with a path in it",
        "  check:\n    uses: evaluate",
        "  ../../check:\n    uses: evaluate",
        "steps.../../check",
        "step name '../../check' cannot name a folder of job dirs: it would not be one folder under <root>",
        "rename the step: any name but '.' or '..', without '/' or '\\'",
    ),
    Case(
        "absolute step name",
        "  check:\n    uses: evaluate",
        "  /tmp/check:\n    uses: evaluate",
        "steps./tmp/check",
        "step name '/tmp/check' cannot name a folder of job dirs",
        "rename the step: any name but '.' or '..', without '/' or '\\'",
    ),
    Case(
        "fsx:/// target that leaves the root",
        "target: fsx:///datasets/digits}",
        "target: fsx:///../../datasets/digits}",
        "steps.data.with",
        "target 'fsx:///../../datasets/digits' leaves the launcher's root",
        "write the path without '..', e.g. fsx:///datasets/x",
    ),
    Case(
        "experiment whose artifacts would leave the SQLite store's folder",
        "experiment: digits}",
        "experiment: ../../digits}",
        "tracking",
        "experiment '../../digits' would put its artifacts outside the mlartifacts folder",
        "give the experiment a name without '..' that does not start with '/'",
    ),
    Case(
        "fsx target with a file system id needs an s3 source",
        "target: fsx:///datasets/digits}",
        "target: fsx://fs-0123456789abcdef0/datasets/digits}",
        "steps.data.with",
        "an fsx://fs-0123456789abcdef0/ target is linked to S3, so the source must be s3://..., "
        "not 'builtin://digits'",
        "upload the data to S3 and use s3://bucket/prefix/, or stage it to fsx:///<path>",
    ),
    Case(
        "fsx target with a malformed file system id",
        "with: {source: builtin://digits, target: fsx:///datasets/digits}",
        "with: {source: s3://b/digits/, target: fsx://fs-XYZ/datasets/digits}",
        "steps.data.with",
        "'fs-XYZ' is not an FSx file system id",
        "write the target as fsx://fs-0123456789abcdef0/<path>",
    ),
    Case(
        "fsx target that names no folder",
        "with: {source: builtin://digits, target: fsx:///datasets/digits}",
        "with: {source: s3://b/digits/, target: fsx://fs-0123456789abcdef0/}",
        "steps.data.with",
        "target 'fsx://fs-0123456789abcdef0/' names no folder inside the file system",
        "add a path such as fsx://fs-0123456789abcdef0/datasets/x",
    ),
    Case(
        "fsx settings with a target that is not an FSx file system",
        "target: fsx:///datasets/digits}",
        "target: fsx:///datasets/digits, fsx: {preload: true}}",
        "steps.data.with",
        "fsx settings apply only to an fsx://<file-system-id>/<path> target, not 'fsx:///datasets/digits'",
        "remove fsx",
    ),
    Case(
        "verify on an fsx target that tunepod does not copy",
        "with: {source: builtin://digits, target: fsx:///datasets/digits}",
        "with: {source: s3://b/digits/, target: fsx://fs-0123456789abcdef0/d, verify: true}",
        "steps.data.with",
        "verify has no effect on an fsx://fs-0123456789abcdef0/ target",
        "remove verify, or stage to fsx:///<path>",
    ),
    Case(
        "export: top_k that would silently do nothing",
        "  promote:\n",
        "  save:\n    uses: export\n    needs: [search]\n    with: {file_system_id: fs-0123456789abcdef0, "
        "s3_prefix: s3://b/c/, trials: completed, top_k: 2}\n  promote:\n",
        "steps.save.with",
        "top_k has no effect with trials: completed",
        "remove top_k or use trials: best",
        line_of="    with: {file_system_id",
    ),
    # --- how the steps connect, and the files they name
    Case(
        "unknown step in needs",
        "needs: [search]",
        "needs: [serch]",
        "steps.check.needs[0]",
        "unknown step 'serch' (did you mean 'search'?)",
        "data, search, check, promote",
    ),
    Case(
        "cycle",
        "needs: [data]",
        "needs: [data, promote]",
        "steps.search.needs",
        "the steps form a cycle: search -> promote -> check -> search",
        "remove one of these needs",
    ),
    Case(
        "input of the wrong kind",
        "needs: [check]",
        "needs: [data]  # not an evaluate step",
        "steps.promote.needs[0]",
        "'data' is a stage step, but a register step takes exactly one evaluate step",
        "remove 'data' from the needs of 'promote'",
    ),
    Case(
        "tune without a stage",
        "needs: [data]",
        "needs: []",
        "steps.search.needs",
        "a tune step takes exactly one stage step; none is listed",
        "add one of these steps to needs: data",
    ),
    Case(
        "export of an evaluate step",
        "  promote:\n",
        "  save:\n    uses: export\n    needs: [check]\n    with: {file_system_id: fs-0123456789abcdef0, "
        "s3_prefix: s3://b/c/}\n  promote:\n",
        "steps.save.needs[0]",
        "'check' is an evaluate step, but an export step takes exactly one tune or train step",
        "remove 'check' from the needs of 'save'",
        line_of="    needs: [check]",
    ),
    Case(
        "step needed twice",
        "needs: [search]",
        "needs: [search, search]",
        "steps.check.needs[1]",
        "step 'search' is needed twice",
        "remove the second 'search'",
    ),
    Case(
        "entrypoint that does not exist",
        "with: {entrypoint: tests/fixtures/specs/dummy_train.py, top_k: 3",
        "with: {entrypoint: tests/fixtures/specs/no_such_eval.py, top_k: 3",
        "steps.check.with.entrypoint",
        f"entrypoint 'tests/fixtures/specs/no_such_eval.py' does not exist (looked for {REPO}/tests/",
        f"a relative path resolves against {REPO}",
    ),
    # --- elastic jobs (resources.min_nodes)
    Case(
        "min_nodes above num_nodes",
        "resources: {num_nodes: 1, procs_per_node: 2}",
        "resources: {num_nodes: 2, min_nodes: 3, procs_per_node: 2}",
        "steps.search.with.train.resources",
        "resources.min_nodes 3 is above num_nodes 2",
        "set min_nodes to at most 2, or num_nodes to at least 3",
    ),
    Case(
        "min_nodes below one",
        "resources: {num_nodes: 1, procs_per_node: 2}",
        "resources: {num_nodes: 2, min_nodes: 0, procs_per_node: 2}",
        "steps.search.with.train.resources.min_nodes",
        "must be greater than or equal to 1, got 0",
        "set min_nodes to 1 or more",
    ),
    Case(
        "an elastic job with a fixed parallelism layout",
        "resources: {num_nodes: 1, procs_per_node: 2}",
        "resources: {num_nodes: 2, min_nodes: 1, procs_per_node: 2}\n        parallelism: {data: 4}",
        "steps.search.with.train",
        "a parallelism layout is fixed at submission",
        "remove min_nodes, or the parallelism block",
        line_of="      train:",
    ),
    Case(
        "an elastic job on a launcher that cannot keep it alive across a node loss",
        "resources: {num_nodes: 1, procs_per_node: 2}",
        "resources: {num_nodes: 2, min_nodes: 1, procs_per_node: 2}",
        "",
        "steps.search.with.train.resources.min_nodes asks for an elastic job, and the local launcher "
        "cannot keep a job alive across a node loss",
        "remove min_nodes, or use a slurm or hyperpod_eks launcher",
        line_of="name: digits-hpo",
    ),
    # --- the document itself
    Case(
        "YAML syntax error",
        "num_trials: 16",
        "num_trials: 16: 17",
        "",
        "YAML syntax error: mapping values are not allowed",
        "check the indentation",
    ),
]


# The valid fixture's search under PBT instead of a pruner: each case below edits its pbt block.
SEARCH_WITH_A_PRUNER = (
    "num_trials: 16\n      num_parallel: 2\n      sampler: tpe\n"
    "      pruner: {kind: hyperband, min_resource: 2}"
)
SEARCH_UNDER_PBT = "num_parallel: 4\n      sampler: tpe\n      pbt: {population: 4, interval: 2, "


def pbt_case(case_id: str, pbt: str, path: str, message: str, fix: str) -> Case:
    """A case of the valid fixture's search under ``pbt: {population: 4, interval: 2, <pbt>}``."""
    new = SEARCH_UNDER_PBT + pbt + "}"
    return Case(
        case_id, SEARCH_WITH_A_PRUNER, new, f"steps.search.with.{path}", message, fix, line_of="pbt: "
    )


PBT_CASES = [
    pbt_case(
        f"perturb factors {factors}",
        f"perturb: {{factors: {factors}}}",
        "pbt.perturb.factors",
        f"pbt.perturb.factors {shown} holds a factor that is not a finite number",
        "two positive finite factors, e.g. [0.8, 1.2]",
    )
    for factors, shown in [
        ("[.nan, 1.2]", "[nan, 1.2]"),
        ("[0.8, .inf]", "[0.8, inf]"),
        ("[-.inf, 2]", "[-inf, 2.0]"),
    ]
] + [
    pbt_case(
        f"no decision before max_resource {max_resource}",
        f"max_resource: {max_resource}",
        "pbt",
        f"pbt.interval 2 is not below pbt.max_resource {max_resource}: members are judged every interval",
        "set interval below max_resource, max_resource to a member's full training",
    )
    for max_resource in (1, 2)
]

ASHA_CASES = [
    Case(
        f"asha without a rung ({options})",
        "pruner: {kind: hyperband, min_resource: 2}",
        f"pruner: {{kind: asha, {options}}}",
        "steps.search.with.pruner",
        f"pruner kind asha with {shown} has no rung",
        "set min_resource below max_resource (or leave it out: max_resource // reduction_factor)",
    )
    for options, shown in [
        ("min_resource: 4, max_resource: 4", "min_resource 4 and max_resource 4"),
        ("max_resource: 1", "min_resource 1 and max_resource 1"),  # the default min_resource is 1 there
        ("min_resource: 5, max_resource: 4", "min_resource 5 and max_resource 4"),
    ]
]


@pytest.mark.parametrize("case", PBT_CASES, ids=[case.id for case in PBT_CASES])
def test_a_pbt_error_names_file_line_path_and_fix(tmp_path: Path, case: Case) -> None:
    test_error_names_file_line_path_and_fix(tmp_path, case)


@pytest.mark.parametrize("case", ASHA_CASES, ids=[case.id for case in ASHA_CASES])
def test_an_asha_error_names_file_line_path_and_fix(tmp_path: Path, case: Case) -> None:
    test_error_names_file_line_path_and_fix(tmp_path, case)


def test_a_quoted_population_is_read_as_the_number_it_holds(tmp_path: Path) -> None:
    text = VALID.replace(
        SEARCH_WITH_A_PRUNER, SEARCH_UNDER_PBT.replace("population: 4", "population: '4'") + "}"
    )
    spec = parse_spec(text, "pbt.yaml", base_dir=REPO)
    search = spec.steps["search"].with_
    assert search.pbt is not None and (search.pbt.population, search.num_trials) == (4, 4)


@pytest.mark.parametrize("population", ["four", "'1'", "null"])
def test_a_population_that_is_no_number_is_its_own_error_not_a_missing_num_trials(
    tmp_path: Path, population: str
) -> None:
    text = VALID.replace(SEARCH_WITH_A_PRUNER, SEARCH_UNDER_PBT.replace("4,", f"{population},", 1) + "}")
    _, error = load_broken(tmp_path, text)
    assert [issue.path for issue in error.issues] == ["steps.search.with.pbt.population"]


def line_of(text: str, fragment: str) -> int:
    """1-based line of the first line of ``text`` that contains ``fragment``'s first line."""
    first = fragment.strip("\n").splitlines()[0]
    return next(number for number, line in enumerate(text.splitlines(), 1) if first in line)


def load_broken(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()) -> tuple[Path, SpecError]:
    spec_file = tmp_path / "pipeline.yaml"
    spec_file.write_text(text)
    with pytest.raises(SpecError) as caught:
        load_spec(spec_file, overrides, base_dir=REPO)
    return spec_file, caught.value


def the_issue(error: SpecError, path: str) -> SpecIssue:
    found = [issue for issue in error.issues if issue.path == path]
    assert found, f"no issue at {path!r}; got:\n{error}"
    return found[0]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_error_names_file_line_path_and_fix(tmp_path: Path, case: Case) -> None:
    assert case.old in VALID, "the edit must apply to the valid fixture"
    text = VALID.replace(case.old, case.new, 1)
    spec_file, error = load_broken(tmp_path, text)

    issue = the_issue(error, case.path)
    line = line_of(text, case.line_of or case.new or case.old)
    rendered = str(error)
    assert f"{spec_file}:{line}: {case.path or '<root>'}: " in rendered
    assert issue.line == line
    assert case.message in issue.message
    assert case.fix in issue.fix
    assert f"    fix: {issue.fix}" in rendered
    # What pydantic would show and a user never should: its URL, its tags, its wording.
    for leak in ("pydantic", "Input should", ".tune.", ".local.", "; fix:"):
        assert leak not in rendered


@pytest.mark.parametrize(
    ("text", "line", "message", "fix"),
    [
        ("", 1, "the spec is empty", "examples/digits/pipeline.yaml"),
        ("# only a comment\n", 1, "the spec is empty", "declare name, tracking, launcher and steps"),
        ("\n- a\n- b\n", 2, "expected a mapping at the top (name:, tracking:, steps:), got a list", "top"),
        ("name: x\n  bad: indent\n", 2, "YAML syntax error", "on line 2"),
    ],
    ids=["empty", "comment only", "not a mapping", "bad indentation"],
)
def test_unusable_document(tmp_path: Path, text: str, line: int, message: str, fix: str) -> None:
    spec_file, error = load_broken(tmp_path, text)
    [issue] = error.issues
    assert (issue.line, issue.path) == (line, "")
    assert message in issue.message
    assert fix in issue.fix
    assert f"{spec_file}:{line}: <root>: " in str(error)


def test_missing_file_is_a_spec_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_spec(tmp_path / "nope.yaml")
    assert f"file not found (looked for {tmp_path / 'nope.yaml'})" in str(caught.value)


def test_every_issue_is_reported_in_file_order(tmp_path: Path) -> None:
    text = (
        VALID.replace("direction: maximize", "direction: max")
        .replace("num_trials: 16", "num_trials: ten")
        .replace("launcher: {kind: local}", "launcher: {kind: local, bogus: 1}")
    )
    _, error = load_broken(tmp_path, text)
    assert [issue.path for issue in error.issues] == [
        "launcher.bogus",
        "steps.search.with.study.direction",
        "steps.search.with.num_trials",
    ]
    assert "(3 errors)" in str(error)


def test_every_connection_problem_is_reported(tmp_path: Path) -> None:
    text = (
        VALID.replace("needs: [search]", "needs: [search, search]")
        .replace("needs: [check]", "needs: [chek]")
        .replace("entrypoint: tests/fixtures/specs/dummy_train.py", "entrypoint: missing.py", 1)
    )
    _, error = load_broken(tmp_path, text)
    assert {issue.path for issue in error.issues} == {
        "steps.check.needs[1]",
        "steps.promote.needs[0]",
        "steps.search.with.train.entrypoint",
    }


# ---------------------------------------------------------------------------------------------- --set


@pytest.mark.parametrize(
    ("override", "read_back"),
    [
        ("steps.search.with.num_trials=40", lambda spec: spec.steps["search"].with_.num_trials == 40),
        ("steps.search.with.seed=7", lambda spec: spec.steps["search"].with_.seed == 7),
        ("launcher.root=/tmp/shared", lambda spec: spec.launcher.root == "/tmp/shared"),
        (
            "steps.search.with.sampler=random",
            lambda spec: spec.steps["search"].with_.sampler.kind == "random",
        ),
        (
            "steps.search.with.train.resources={num_nodes: 2, procs_per_node: 4}",
            lambda spec: spec.steps["search"].with_.train.resources.num_nodes == 2,
        ),
    ],
)
def test_override_changes_the_value(override: str, read_back: Callable[[PipelineSpec], bool]) -> None:
    spec = parse_spec(VALID, "valid.yaml", [override], base_dir=REPO)
    assert read_back(spec)
    assert parse_spec(VALID, "valid.yaml", base_dir=REPO) != spec


def test_override_creates_missing_mappings() -> None:
    spec = parse_spec(
        VALID,
        "valid.yaml",
        ["steps.extra.uses=stage", "steps.extra.with.source=/data", "steps.extra.with.target=/shared"],
        base_dir=REPO,
    )
    assert spec.steps["extra"].uses == "stage"


@pytest.mark.parametrize("value", ["0", "12", "-3", "+4", "007", "1_000", "0x1f", "5 ", "1e3", "yes", "'12'"])
def test_an_override_value_is_read_as_yaml_reads_it(value: str) -> None:
    # Plain decimal integers skip the YAML parser (the webhook checks one spec per delivery): the
    # shortcut must give what YAML gives, and leave everything else to YAML.
    path, parsed = _parse_override(f"steps.search.with.seed={value}")
    assert path == ("steps", "search", "with", "seed")
    assert parsed == yaml.safe_load(value)
    assert type(parsed) is type(yaml.safe_load(value))


def test_a_text_parsed_once_is_not_changed_by_the_overrides_of_an_earlier_parse() -> None:
    # The YAML of a text is parsed once and kept (a webhook receiver checks one spec for every
    # delivery): each parse must work on its own copy of the document and of its line map.
    broken = VALID.replace("num_trials: 16", "num_trials: twelve")
    assert broken != VALID
    fixed = parse_spec(broken, "broken.yaml", ["steps.search.with.num_trials=3"], base_dir=REPO)
    assert fixed.steps["search"].with_.num_trials == 3
    with pytest.raises(SpecError) as raised:
        parse_spec(broken, "broken.yaml", base_dir=REPO)
    issue = the_issue(raised.value, "steps.search.with.num_trials")
    assert issue.line == line_of(broken, "num_trials: twelve")
    parse_spec(
        VALID,
        "valid.yaml",
        ["steps.extra.uses=stage", "steps.extra.with.source=/d", "steps.extra.with.target=/t"],
        base_dir=REPO,
    )
    assert "extra" not in parse_spec(VALID, "valid.yaml", base_dir=REPO).steps


@pytest.mark.parametrize(
    ("override", "path", "message"),
    [
        ("steps.search.with.num_trials=ten", "steps.search.with.num_trials", "expected an integer"),
        ("steps.check.needs=[nope]", "steps.check.needs[0]", "unknown step 'nope'"),
        ("steps.search.with.bogus=1", "steps.search.with.bogus", "unknown key 'bogus'"),
        ("steps.search.with.space={a: {type: int, low: x, high: 1}}", "steps.search.with.space.a.low", "'x'"),
        ("steps.new.uses=stage", "steps.new.with", "missing required key 'with'"),
        ("steps.search.with.num_trials", "steps.search.with.num_trials", "malformed override"),
        ("=3", "", "malformed override"),
        ("name.first=x", "name.first", "the path goes through name, which is 'digits-hpo', not a mapping"),
        ("name=[unclosed", "name", "the value is not valid YAML"),
    ],
)
def test_problem_from_an_override_is_located_by_the_override(
    tmp_path: Path, override: str, path: str, message: str
) -> None:
    spec_file, error = load_broken(tmp_path, VALID, (override,))
    issue = the_issue(error, path)
    assert isinstance(issue, OverrideIssue)
    assert issue.line is None
    assert message in issue.message
    assert issue.fix
    assert f"--set {override}: {path or '<root>'}: {issue.message}" in str(error)
    assert f"{spec_file}:" not in str(error)


def test_a_problem_under_a_twice_overridden_mapping_is_located_by_the_last_override(tmp_path: Path) -> None:
    # The second override replaces lines the first already dropped; the problem is the second's.
    first = "steps.search.with.space={lr: {type: float, low: 0.1, high: 1}}"
    second = "steps.search.with.space.lr={type: float, low: x, high: 1}"
    _, error = load_broken(tmp_path, VALID, (first, second))
    issue = the_issue(error, "steps.search.with.space.lr.low")
    assert isinstance(issue, OverrideIssue)
    assert issue.override == second


def test_file_and_override_problems_keep_their_own_locations(tmp_path: Path) -> None:
    text = VALID.replace("direction: maximize", "direction: max")
    spec_file, error = load_broken(tmp_path, text, ("steps.search.with.num_parallel=-1",))
    rendered = str(error)
    assert f"{spec_file}:{line_of(text, 'direction: max')}: steps.search.with.study.direction" in rendered
    expected = "--set steps.search.with.num_parallel=-1: steps.search.with.num_parallel: must be greater"
    assert expected in rendered


# ---------------------------------------------------------------------------------------------- files


def test_entrypoints_resolve_against_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as caught:
        load_spec(VALID_PATH)
    assert f"looked for {tmp_path}/tests/fixtures/specs/dummy_train.py" in str(caught.value)
    assert load_spec(VALID_PATH, check_files=False).name == "digits-hpo"
    assert load_spec(VALID_PATH, base_dir=REPO).name == "digits-hpo"


# ---------------------------------------------------------------------------------------------- hash, dump


def test_dump_round_trips_and_hash_ignores_layout() -> None:
    spec = parse_spec(VALID, "valid.yaml", base_dir=REPO)
    dumped = dump_spec(spec)
    assert "with:" in dumped and "with_:" not in dumped
    assert "cancel_grace_s: 10.0" in dumped  # defaults are resolved
    again = parse_spec(dumped, "dumped.yaml", base_dir=REPO)
    assert again == spec
    assert spec_hash(again) == spec_hash(spec)
    assert len(spec_hash(spec)) == 64


def test_hash_changes_with_meaning() -> None:
    spec = parse_spec(VALID, "valid.yaml", base_dir=REPO)
    changed = parse_spec(VALID, "valid.yaml", ["steps.search.with.num_trials=17"], base_dir=REPO)
    assert spec_hash(changed) != spec_hash(spec)
