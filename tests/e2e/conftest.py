"""What the end-to-end tests share: ``runs``, `tunepod run` as a process of its own on a study's spec."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from faults_support import FaultStudy, MakeRuns, Tunepod


@pytest.fixture
def runs(prefect_api: None) -> Iterator[MakeRuns]:
    """``runs(study, **env)``: writes the study's spec and starts `tunepod run`s on it against the
    session's Prefect server. At teardown, kills whatever the test left running (orchestrators, jobs)."""
    from prefect.settings import PREFECT_API_URL

    base = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "200"}
    made: list[Tunepod] = []

    def make(study: FaultStudy, **env: str) -> Tunepod:
        tunepod = Tunepod(study.write(), {**base, **env})
        made.append(tunepod)
        return tunepod

    yield make
    for tunepod in made:
        tunepod.close()
