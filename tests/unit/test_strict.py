"""Names that cannot be mistyped: settings' environment variables and request fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from drafter.settings import DrafterSettings
from server.shared.protocol import PrefillRequest
from server.shared.strict import closest, did_you_mean, fields_at, unknown_variables
from server.verifier.settings import VerifierSettings


def test_the_closest_known_name_is_suggested():
    assert closest("max_token", ["max_tokens", "temperature"]) == "max_tokens"
    assert closest("zzz", ["max_tokens"]) is None
    assert did_you_mean("n_pastt", ["n_past", "draft_tokens"]) == "; did you mean 'n_past'?"
    assert "known: draft_tokens, n_past" in did_you_mean("qqq", ["n_past", "draft_tokens"])


def test_unknown_variables_of_a_prefix_are_named_with_the_closest_setting():
    environ = {"VERIFIER_API_KEY": "k", "VERIFIER_N_CTX": "64", "OTHER": "x"}
    (message,) = unknown_variables("VERIFIER_", ["api_keys", "n_ctx"], environ)
    assert message == "VERIFIER_API_KEY is not a setting; did you mean VERIFIER_API_KEYS?"


@pytest.mark.parametrize(
    ("settings", "variable", "meant"),
    [
        (VerifierSettings, "VERIFIER_API_KEY", "VERIFIER_API_KEYS"),
        (VerifierSettings, "VERIFIER_MAX_SESSION", "VERIFIER_MAX_SESSIONS"),
        (DrafterSettings, "DRAFTER_SERVR", "DRAFTER_SERVER"),
    ],
)
def test_a_mistyped_variable_stops_the_settings_naming_the_one_meant(
    monkeypatch, settings, variable, meant
):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(ValidationError, match=f"{variable} is not a setting; did you mean {meant}"):
        settings()


def test_the_fields_at_a_path_are_those_of_the_model_found_there():
    assert "temperature" in fields_at(PrefillRequest, ["sampling"])
    assert "prompt" in fields_at(PrefillRequest, [])
    assert fields_at(PrefillRequest, ["prompt"]) == []


def test_variables_a_container_platform_sets_for_a_service_of_that_name_are_not_refused():
    environ = {
        "VERIFIER_SERVICE_HOST": "10.0.0.1",
        "VERIFIER_SERVICE_PORT": "8000",
        "VERIFIER_SERVICE_PORT_HTTP": "8000",
        "VERIFIER_PORT": "tcp://10.0.0.1:8000",
        "VERIFIER_PORT_8000_TCP_ADDR": "10.0.0.1",
        "VERIFIER_NCTX": "64",
    }
    (message,) = unknown_variables("VERIFIER_", ["n_ctx", "api_keys"], environ)
    assert message == "VERIFIER_NCTX is not a setting; did you mean VERIFIER_N_CTX?"
