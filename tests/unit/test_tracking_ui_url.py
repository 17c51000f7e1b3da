"""Links into MLflow use ``tracking.ui_url``: a setting, never a hard-coded localhost."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tunepod.pipeline import _ui_command
from tunepod.spec.models import TrackingSpec


def tracking(**fields: str) -> TrackingSpec:
    return TrackingSpec.model_validate({"experiment": "e", **fields})


def test_the_ui_url_is_the_setting_then_the_tracking_server_then_mlflow_ui() -> None:
    assert tracking(uri="sqlite:///x.db", ui_url="https://mlflow.example.com").browse_url == (
        "https://mlflow.example.com"
    )
    assert tracking(uri="https://mlflow.internal:5000").browse_url == "https://mlflow.internal:5000"
    assert tracking(uri="sqlite:///x.db").browse_url == "http://127.0.0.1:5000"


def test_a_ui_url_that_is_not_http_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="ui_url"):
        tracking(ui_url="mlflow.example.com")


def test_a_tracking_server_needs_no_mlflow_ui_command() -> None:
    assert _ui_command("http://127.0.0.1:5000") == ""
    assert _ui_command("sqlite:///x.db").endswith("ui --backend-store-uri sqlite:///x.db")
