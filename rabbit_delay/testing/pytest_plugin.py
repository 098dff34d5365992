"""A pytest fixture for rabbit_delay.testing, opt-in:

    # conftest.py
    import pytest
    from myapp import app

    pytest_plugins = ["rabbit_delay.testing.pytest_plugin"]

    @pytest.fixture
    def rabbit_delay_app():
        return app

    # test_orders.py
    def test_timeout(rabbit_delay_broker):
        rabbit_delay_broker.publisher.publish_delayed(...)
        rabbit_delay_broker.advance("30m")

`rabbit_delay_broker` is a TestBroker on the app (or topology) your `rabbit_delay_app`
fixture returns, closed after the test (the worker stopped, the app's own guard put back).
Give `rabbit_delay_broker_options` (a dict of TestBroker keyword arguments, e.g.
`{"version": "3.10.8"}`) to change how it is made. Not registered by installing
rabbit-delay: a test suite chooses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rabbit_delay.testing._kit import TestBroker


@pytest.fixture
def rabbit_delay_broker_options() -> dict[str, Any]:
    """Keyword arguments for the TestBroker of `rabbit_delay_broker` (none by default)."""
    return {}


@pytest.fixture
def rabbit_delay_broker(
    request: pytest.FixtureRequest, rabbit_delay_broker_options: dict[str, Any]
) -> Iterator[TestBroker]:
    """A TestBroker on the app of the `rabbit_delay_app` fixture (yours to define)."""
    try:
        app = request.getfixturevalue("rabbit_delay_app")
    except pytest.FixtureLookupError:
        raise pytest.UsageError(
            "rabbit_delay_broker needs a fixture named rabbit_delay_app that returns your "
            "rabbit_delay._consumer.app.App (or a Topology): define it in your conftest.py"
        ) from None
    with TestBroker(app, **rabbit_delay_broker_options) as broker:
        yield broker
