"""Hook secrets `tunepod up` generates for variables the user did not export (the whole path, through
a real stack and a signed delivery, runs in tests/e2e/test_ui.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tunepod.stack.secrets import generate_missing, unset_secret_variables
from tunepod.webhook.signatures import standard_key


def hooks_file(tmp_path: Path) -> Path:
    hooks = {
        "a": {"spec": "s.yaml", "secrets": [{"env": "HOOK_A_SECRET"}, {"file": str(tmp_path / "old")}]},
        "b": {"spec": "s.yaml", "scheme": "github", "secrets": [{"env": "HOOK_B_SECRET"}]},
    }
    path = tmp_path / "webhooks.yaml"
    path.write_text(yaml.safe_dump({"hooks": hooks}))
    return path


def test_only_unexported_variables_get_a_secret_kept_private_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_A_SECRET", "exported")
    monkeypatch.delenv("HOOK_B_SECRET", raising=False)
    config, folder = hooks_file(tmp_path), tmp_path / "home" / "secrets"

    first = generate_missing(config, folder)
    assert list(first.env) == ["HOOK_B_SECRET"]
    assert first.files == {"HOOK_B_SECRET": folder / "HOOK_B_SECRET"}
    assert folder.stat().st_mode & 0o777 == 0o700
    assert first.files["HOOK_B_SECRET"].stat().st_mode & 0o777 == 0o600
    assert len(standard_key(first.env["HOOK_B_SECRET"])) == 24
    assert "HOOK_B_SECRET" in first.note() and str(folder) in first.note()

    again = generate_missing(config, folder)  # a later `up`: the same secret, not a new one
    assert again.env == first.env

    monkeypatch.setenv("HOOK_B_SECRET", "now-exported")  # an exported variable wins over the file
    assert generate_missing(config, folder).env == {}
    assert generate_missing(config, folder).note() == ""


def test_a_config_the_receiver_will_reject_generates_nothing(tmp_path: Path) -> None:
    """The receiver reports what is wrong with its config (with the hook and field); `up` shows its log."""
    bad = tmp_path / "webhooks.yaml"
    bad.write_text("hooks: [not, a, mapping]\n")
    assert unset_secret_variables(bad, {}) == []
    assert unset_secret_variables(tmp_path / "missing.yaml", {}) == []
