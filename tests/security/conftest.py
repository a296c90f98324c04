"""The in-process API on both databases (tests/api/conftest.py), for the security suites."""

from tests.api.conftest import api  # noqa: F401
