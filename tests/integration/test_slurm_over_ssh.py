"""The Slurm launcher's ssh mode for real: every sbatch, squeue, scontrol and scancel goes through
``ssh root@127.0.0.1 -p 2222`` to the loopback sshd of ``scripts/sshd-up``, in front of the local Slurm
cluster of ``scripts/slurm-up``.

The "head node" is this host, so the job dirs under ``tmp_path`` are seen at the same paths on both
sides: the shared filesystem the ssh mode documents as its requirement. The whole launcher contract
runs, plus how failures surface: a command that fails remotely keeps its stderr, and ssh's own failure
(nobody listening) is a ``TransientError``. A connection dropped right after sbatch queued a job is in
``test_slurm_exactly_once.py``.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from sshd import TARGET, require_sshd, ssh_options
from test_slurm_launcher import SlurmContract

from tunepod.errors import TransientError
from tunepod.launch.base import Launcher
from tunepod.launch.runner import SSH_CONNECTION_FAILED, CommandFailed, SshRunner
from tunepod.launch.slurm import SlurmLauncher
from tunepod.spec.models import SlurmLauncherSpec

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _sshd_up() -> None:
    require_sshd()


def ssh_slurm_spec(root: Path, **fields: object) -> SlurmLauncherSpec:
    # The repo's venv python on the "compute node" (this host); a short cache keeps the tests brisk.
    values = {
        "kind": "slurm",
        "root": str(root),
        "python": sys.executable,
        "poll_cache_s": 0.2,
        "ssh": TARGET,
        "ssh_options": ssh_options(),
        **fields,
    }
    return SlurmLauncherSpec.model_validate(values)


def unused_loopback_port() -> int:
    """A port nothing listens on right now (the kernel picked it free and it is closed again)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class TestSlurmOverSshContract(SlurmContract):
    @pytest.fixture
    def launcher(self, tmp_path: Path) -> Launcher:
        launcher = SlurmLauncher(ssh_slurm_spec(tmp_path / "shared"))
        assert isinstance(launcher.runner, SshRunner)  # the spec's ssh field chose the ssh path
        return launcher


def test_remote_command_failure_keeps_its_stderr() -> None:
    runner = SshRunner(TARGET, ssh_options())
    with pytest.raises(CommandFailed) as failed:
        runner.run(["scontrol", "show", "job", "not-a-job-id"])
    error = failed.value
    assert not isinstance(error, TransientError)  # the command ran and said no: a retry repeats it
    assert error.returncode not in (0, SSH_CONNECTION_FAILED)
    assert "Invalid job id" in error.stderr
    assert "Invalid job id" in str(error)
    assert error.argv[-1] == "scontrol show job not-a-job-id"  # what ran remotely, as one quoted string


def test_stdin_and_awkward_arguments_arrive_intact() -> None:
    runner = SshRunner(TARGET, ssh_options())
    script = "import sys; print(repr(sys.argv[1:]), sys.stdin.read())"
    args = ["a  b", "it's", '"q"', "$HOME", "`id`", "*", ""]
    done = runner.run([sys.executable, "-c", script, *args], input="from stdin")
    assert done.stdout.strip() == f"{args!r} from stdin"


def test_ssh_failure_is_transient(tmp_path: Path) -> None:
    port = unused_loopback_port()
    launcher = SlurmLauncher(ssh_slurm_spec(tmp_path / "shared", ssh_options=ssh_options(port)))
    with pytest.raises(TransientError) as failed:
        launcher.runner.run(["squeue", "--noheader"], timeout_s=30)
    assert isinstance(failed.value, CommandFailed)
    assert failed.value.returncode == SSH_CONNECTION_FAILED
    assert "Connection refused" in failed.value.stderr
