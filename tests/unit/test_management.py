"""How the management API's refusals are read (the HTTP exchanges themselves:
tests/integration/test_permissions.py and test_tls.py)."""

from __future__ import annotations

import io
import json
import urllib.error
from email.message import Message

import pytest

from rabbit_delay import AccessRefused, ManagementUnavailable
from rabbit_delay._io.management import ManagementRefused, RefusalKind, _reason, _refused
from rabbit_delay._urls import ManagementEndpoint

ENDPOINT = ManagementEndpoint("http://127.0.0.1:15672", "worker", "s3cret", "/")


def _http_error(status: int, body: object) -> urllib.error.HTTPError:
    data = json.dumps(body).encode() if not isinstance(body, bytes) else body
    return urllib.error.HTTPError(
        ENDPOINT.base, status, "Unauthorized", Message(), io.BytesIO(data)
    )


def _classify(status: int, reason: str) -> Exception:
    return _refused(ENDPOINT, status, reason, doing="reading", permission="read")


def test_the_reason_comes_from_rabbitmqs_json_body() -> None:
    error = _http_error(401, {"error": "not_authorised", "reason": "Not management user"})
    assert _reason(error) == "Not management user"
    assert _reason(_http_error(401, b"<html>proxy</html>")) == "Unauthorized"


def test_a_user_without_the_management_tag_is_told_how_to_fix_it() -> None:
    error = _classify(401, "Not management user")
    assert isinstance(error, ManagementRefused)
    assert isinstance(error, ManagementUnavailable)  # callers fall back to AMQP
    assert error.refusal is RefusalKind.NO_TAG
    assert "monitoring" in str(error)
    assert "--no-management" in str(error)
    assert "s3cret" not in str(error)
    forbidden = _classify(403, "Forbidden")
    assert isinstance(forbidden, ManagementRefused)
    assert forbidden.refusal is RefusalKind.NO_TAG


@pytest.mark.parametrize(
    "reason", ["Login failed", "Not_Authorized", "User can only log in via localhost"]
)
def test_any_other_401_is_a_refused_login(reason: str) -> None:
    error = _classify(401, reason)
    assert isinstance(error, ManagementRefused)
    assert error.refusal is RefusalKind.LOGIN
    assert "refused the login of user 'worker'" in str(error)
    assert reason in str(error)


def test_a_missing_vhost_permission_is_access_refused_naming_it() -> None:
    reason = (
        "ACCESS_REFUSED - access to queue 'ns.v1.parking.q' in vhost '/' refused for user 'worker'"
    )
    error = _classify(401, reason)
    assert isinstance(error, AccessRefused)
    assert not isinstance(error, ManagementUnavailable)  # no fallback: the user lacks a right
    assert error.permission == "read"
    assert "'read' permission" in str(error)
    assert "127.0.0.1:15672" in str(error)
