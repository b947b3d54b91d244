"""Shared fixtures."""

import pytest

from tests.on_targets import TARGETS


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    """Each target a test should pass on: ``interp`` and, with a C compiler, ``cpu``."""
    return request.param
