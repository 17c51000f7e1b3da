"""The mutants: small bugs in the tuning loop's library code, each one a plausible slip of a refactor.

They were written from the library code and its documentation alone, without reading the simulation
(``tests/simulation``) or what it checks: a skeptical reviewer's guesses at what could go wrong, so
that how many of them the simulation finds measures the simulation, not its authors' memory of it.

Each mutant is a source edit: ``find`` must occur exactly once in ``path`` and becomes ``replace``;
the mutated module is the one that runs. ``why`` says what breaks and under which fault it should
show. ``escapes`` stays None until a mutant survives and someone has worked out why the simulation
cannot find it (then it says so); a survivor without a reason is a gap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One bug put into one library file."""

    name: str
    path: str
    """The library file, relative to the repository root."""
    find: str
    """An exact snippet of ``path``, occurring there exactly once."""
    replace: str
    why: str
    """The bug, and the fault under which it should break an invariant."""
    escapes: str | None = None
    """Why the simulation cannot find it (None: it should, or nobody has worked out why not)."""


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="drive-restart-off-by-one",
        path="tunepod/launch/drive.py",
        find="        if restarts >= self.settings.max_restarts:\n            return False",
        replace="        if restarts > self.settings.max_restarts:\n            return False",
        why="A job that dies (a killed process, a lost node, a hang) is restarted once more than "
        "train.max_restarts allows: with the default of 1, a trial whose job dies twice runs a third "
        "attempt instead of ending FAIL. Needs a seed where one trial's job dies twice.",
    ),
    Mutant(
        name="drive-preempt-save-counted-complete",
        path="tunepod/launch/drive.py",
        find="return state is JobState.SUCCEEDED and self._watchdog.stop_requested_at(handle.job_id) is None",
        replace="return state is JobState.SUCCEEDED",
        why="A job whose script heard a stop signal tunepod did not send (a preemption, a node drain, "
        "the warning before the time limit), saved and exited 0 counts as finished by itself: the "
        "trial is told COMPLETE with the value of a half-trained model instead of being restarted from "
        "its checkpoint (or ending TIMED_OUT). Needs a SIGTERM to a running job whose script listens.",
    ),
    Mutant(
        name="lease-renew-overwrites-successor",
        path="tunepod/launch/lease.py",
        find="            if _names(current, self.owner, lease.generation):\n"
        "                _write(paths, self._record(lease.generation))",
        replace="            if current is not None:\n"
        "                _write(paths, self._record(lease.generation))",
        why="The renewal no longer checks that the lease file still names this holder: a driver that "
        "stalled past the TTL, whose lease another orchestrator took over, writes its old record back "
        "at its next heartbeat and takes the job dir back. The taker is fenced out mid-drive while the "
        "stale driver acts on a job it no longer knows (a second restart, a stop of the new attempt). "
        "Needs a stalled orchestrator beside a second one on the study.",
    ),
    Mutant(
        name="tuner-cap-per-orchestrator",
        path="tunepod/hpo/tuner.py",
        find="        return {t.number for t in running} - set(self._abandoned)\n",
        replace="        return mine - set(self._abandoned)\n",
        why="num_parallel counts only the trials this orchestrator drives: a second orchestrator on the "
        "study, or a restarted one re-attaching to running trials it has not started driving yet, asks "
        "for a full num_parallel more, so more trials run at once than the study allows.",
    ),
    Mutant(
        name="tuner-timeout-recorded-pruned",
        path="tunepod/hpo/tuner.py",
        find="        else:\n            self._fail(number, driven.message)\n",
        replace="        elif driven.outcome is Outcome.TIMED_OUT:\n"
        "            self.trials.tell(number, TrialState.PRUNED)\n"
        "        else:\n            self._fail(number, driven.message)\n",
        why="A trial stopped at its run-time limit (resources.timeout_min) is told PRUNED, as if the "
        "pruner had stopped it, instead of FAIL with its runbook: the recorded outcome and the MLflow "
        "run's status are wrong. Needs a job that runs past its time limit.",
    ),
    Mutant(
        name="tuner-catch-up-without-final",
        path="tunepod/hpo/tuner.py",
        find="            mirror = self._mirror(frozen, params, {})\n"
        "            mirror.finish(self._final(frozen))\n",
        replace="            mirror = self._mirror(frozen, params, {})\n",
        why="A rerun catching up on trials whose MLflow record a crash or an outage left unwritten adds "
        "their mirrors without the final record: the reports arrive, but the run never gets its state "
        "tag, final metrics and end status. Needs an orchestrator killed (or MLflow down until the end) "
        "between telling Optuna and the final record's sync, then a rerun.",
    ),
    Mutant(
        name="asha-rejudge-promoted-rung",
        path="tunepod/hpo/asha.py",
        find="        return 0 if state is None else state.rung + 1",
        replace="        return 0 if state is None else state.rung",
        why="A promoted trial's new job is judged again at the rung it was promoted from: one promoted "
        "for an idle slot (not in that rung's top) is paused again at once, and one promoted by the "
        "rule is paused there once newcomers push it out, each time costing a job and a promotion. "
        "Needs ASHA with a promotion.",
    ),
    Mutant(
        name="asha-finished-trial-still-paused",
        path="tunepod/hpo/asha.py",
        find="    return trial.state is TrialState.RUNNING and state is not None and state.paused",
        replace="    return state is not None and state.paused",
        why="A trial paused and never promoted ends PRUNED at the end of the study with its pause state "
        "left as it was; read as still paused, it is reported PAUSED rather than PRUNED, offered again "
        "for promotion to idle slots, and pruned (its MLflow run closed) again by every later schedule. "
        "Needs ASHA where a paused trial is never promoted.",
    ),
    Mutant(
        name="pbt-continuation-rejudged-at-seed",
        path="tunepod/hpo/pbt.py",
        find="trained = 0 if state is None else state.from_step + 1",
        replace="trained = 0 if state is None else state.from_step",
        why="A continuation counts the donor's checkpoint step as units (one short): when the donor "
        "saved at a boundary's last step, the continuation is judged again at the boundary where its "
        "member was just exploited, still ranks in the bottom on the exploited trial's value there, "
        "and is exploited at its first report, again and again. Needs PBT with an exploit.",
        escapes=(
            "No invariant re-derives PBT's own decisions (which boundary judges a member, who is in the "
            "bottom quantile), as the referee does ASHA's: a continuation exploited again at the boundary "
            "it was copied at still ends counted once, resumed from its recorded donor. A PBT referee "
            "would see it."
        ),
    ),
    Mutant(
        name="base-marker-after-stop",
        path="tunepod/launch/base.py",
        find="            if self.cancel_marker() is None:\n"
        "                write_cancel_marker(self.paths, self.job_id, reason)\n"
        "            if self.status(max_age_s=0).job_state.is_terminal:\n"
        "                return\n"
        "            self.launcher.stop(self)\n",
        replace="            if self.status(max_age_s=0).job_state.is_terminal:\n"
        "                return\n"
        "            self.launcher.stop(self)\n"
        "            if self.cancel_marker() is None:\n"
        "                write_cancel_marker(self.paths, self.job_id, reason)\n",
        why="The cancel marker is written after the stop is sent, not before: an orchestrator that dies "
        "after the stop (or a stop whose reply is lost) leaves an ended job with no reason recorded, "
        "and the rerun reads a pruned, paused or timed-out job as one that failed: it restarts it or "
        "records FAIL. Needs a crash (or a lost reply) while a job is being stopped.",
    ),
    Mutant(
        name="base-attempt-not-incremented",
        path="tunepod/launch/base.py",
        find="attempt = unsent.attempt if unsent else (previous.attempt + 1 if previous else 1)",
        replace="attempt = unsent.attempt if unsent else (previous.attempt if previous else 1)",
        why="A resubmission into a used job dir keeps the previous attempt's number: the restart "
        "budget, counted from submission.json's attempt, never grows, so a job that keeps dying is "
        "restarted forever, and a restarted orchestrator cannot tell attempts apart. Needs a job that "
        "dies more often than train.max_restarts.",
    ),
    Mutant(
        name="slurm-find-ignores-comment",
        path="tunepod/launch/slurm/launcher.py",
        find="mine = [job for job in self.slurm.named(intent.name) if job.comment == comment]",
        replace="mine = list(self.slurm.named(intent.name))",
        why="An intent is resolved by the job's name alone, and every attempt in a job dir has the same "
        "name: an intent of a restart whose sbatch never ran (a crash before it, or a failed sbatch) "
        "adopts the previous attempt's ended job, so the restart never runs and the budget is spent on "
        "it. Needs a crash or a lost sbatch reply at a restart on Slurm.",
        escapes=(
            "It needs an orchestrator killed (or an sbatch reply lost) between a restart's intent and its "
            "sbatch on Slurm, while the previous attempt's job is still listed by name; crashes land in "
            "that window too rarely (none in 1,000 seeds). A crash aimed at it, as crashes are aimed just "
            "after Optuna writes, would make it visible."
        ),
    ),
    Mutant(
        name="local-killed-wrapper-read-as-success",
        path="tunepod/launch/local/launcher.py",
        find="return JobState.SUCCEEDED if self.exit_code == 0 else JobState.FAILED",
        replace="return JobState.FAILED if self.exit_code else JobState.SUCCEEDED",
        why="Only a nonzero exit code reads as failure: a local job whose wrapper was killed (SIGKILL "
        "to its process group: no exit code recorded) and whose processes are gone reads SUCCEEDED, "
        "and the trial is told COMPLETE with its last report instead of being restarted. Needs a kill "
        "of a local job.",
    ),
    Mutant(
        name="sagemaker-upload-after-stop-counted-trained",
        path="tunepod/launch/sagemaker/states.py",
        find='        if status == "Stopping":\n            return False\n        if status == "Uploading":',
        replace='        if status == "Uploading":',
        why="Any Uploading in a stopped job's transitions counts as training finished by itself, also "
        "the upload SageMaker does after tunepod's StopTrainingJob: a pruned, timed-out or hung job "
        "reads SUCCEEDED and its trial is told COMPLETE. Needs a stop of a running SageMaker job.",
        escapes=(
            "The simulated SageMaker takes a StopTrainingJob of a training job from Stopping to Stopped "
            "with no upload after it, so no stopped job's transitions hold an Uploading after Stopping, "
            "the only case this mutant changes."
        ),
    ),
    Mutant(
        name="eks-one-pod-exit-speaks-for-all",
        path="tunepod/launch/hyperpod_eks/exits.py",
        find="    return 0 if pods > 0 and len(codes) >= pods else None",
        replace="    return 0 if codes else None",
        why="A gone object's job counts as exited 0 once any one of its pods recorded 0: a multi-node "
        "job whose other pod died with its node (recording nothing), then deleted by its TTL or by "
        "hand before the driver read its state, is COMPLETE instead of restarted. Needs a two-node EKS "
        "job, a lost node, and the object gone before the next poll.",
        escapes=(
            "The simulated HyperPod operator runs a job of several pods as one program with one exit: a "
            "pod that dies with its node while another records exit 0 is never made."
        ),
    ),
    Mutant(
        name="watchdog-silence-not-idle",
        path="tunepod/launch/watchdog.py",
        find="idle = RankIdle(beat, _idle_s(beat) + silent, silent)",
        replace="idle = RankIdle(beat, _idle_s(beat), silent)",
        why="A rank's idleness is read from its last heartbeat alone: a rank that stops beating (frozen, "
        "killed on a node that stays up, cut off) never grows idle, so a job with such a rank is never "
        "stopped as hung and the trial waits until its time limit, or forever. Needs a stalled rank.",
        escapes=(
            "No simulated rank stops beating while its job goes on running for a hang timeout: a hung "
            "program beats on (stuck in a collective), a killed one ends its job, a stalled job process "
            "stalls at most 30 s (below every drawn hang timeout); and no invariant says a hang is "
            "stopped in time, only that no healthy job is."
        ),
    ),
    Mutant(
        name="outbox-failed-sync-dropped",
        path="tunepod/tracking/outbox.py",
        find="            entry = self._waiting.pop(id(mirror), None)\n"
        "            if entry is not None:\n"
        "                self._waiting[id(mirror)] = entry\n",
        replace="            self._waiting.pop(id(mirror), None)\n",
        why="A mirror whose sync failed (MLflow down, a lost reply) leaves the outbox instead of going "
        "to the back of it: retried only if its driver adds it again, so a final record that failed "
        "once is never written, and flush returns at once with it missing. Needs an MLflow outage at a "
        "trial's end.",
    ),
    Mutant(
        name="mirror-position-saved-before-log",
        path="tunepod/tracking/mirror.py",
        find='        writes.state["synced_offset"] = lines[-1][1]\n'
        '        writes.state["synced_step"] = max(self._state.synced_step, '
        "*(report.step for report in reports))\n",
        replace="        self._save(\n"
        "            synced_offset=lines[-1][1],\n"
        "            synced_step=max(self._state.synced_step, *(report.step for report in reports)),\n"
        "        )\n",
        why="How far the run is up to date is saved before the batch is logged: a batch MLflow did not "
        "take (an outage, a lost reply) is marked as in the run, and those reports never reach it. "
        "Needs MLflow failing while reports are mirrored.",
    ),
    Mutant(
        name="mirror-run-request-after-create",
        path="tunepod/tracking/mirror.py",
        find="            self._save(run_requested=True)\n"
        "            found = self.tracker.start_run(\n"
        "                plan.name, parent_run_id=plan.parent_run_id, "
        "tags={**plan.tags, tags.KEY: plan.key}\n"
        "            )\n",
        replace="            found = self.tracker.start_run(\n"
        "                plan.name, parent_run_id=plan.parent_run_id, "
        "tags={**plan.tags, tags.KEY: plan.key}\n"
        "            )\n"
        "            self._save(run_requested=True)\n",
        why="The request for a run is recorded after MLflow answers, not before: a create whose reply "
        "was lost (or an orchestrator killed right after it) leaves no record that a run was asked "
        "for, the look-up by key is skipped, and the trial gets a second MLflow run. Needs a lost reply "
        "to a run's creation.",
    ),
    Mutant(
        name="checkpoints-copy-returns-source",
        path="tunepod/runtime/checkpoints.py",
        find="    return copied if copied is not None and copied.step == source.step else None",
        replace="    return source if copied is not None and copied.step == source.step else None",
        why="The copy of a donor's newest checkpoint returns the donor's folder instead of the copy: a "
        "PBT continuation's seed then names the donor's live checkpoint folder, which its job goes on "
        "saving into and pruning, so the continuation starts from a later step than its lineage "
        "records (or from nothing, once pruned). Needs PBT with an exploit while the donor still runs.",
    ),
)
