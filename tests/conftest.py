"""Shared fixtures."""

import os

import pytest

# tests compile the same models under different conditions (patched planners, compilers): each compile
# is its own unless a test turns the compile cache on (tests/runtime/test_compile_cache.py)
os.environ["NEOFLOW_COMPILE_CACHE"] = "0"

from tests.on_targets import TARGETS


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    """Each target a test should pass on: ``interp`` and, with a C compiler, ``cpu``."""
    return request.param
