"""The fuzz targets' two hypothesis profiles: `ci` (the default, a few seconds a target, the same examples every run)
and `long` (GB10D_FUZZ=long: thousands of fresh examples a target, failures kept in .hypothesis/ for the next run)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from fuzz_support import PROFILE

# Examples of the mutated inputs are large and slow to build by design (10 KiB logs, whole configs, sockets).
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example, HealthCheck.filter_too_much]

settings.register_profile("ci", deadline=None, derandomize=True, database=None, suppress_health_check=_QUIET, print_blob=True)
settings.register_profile("long", deadline=None, suppress_health_check=_QUIET, print_blob=True)
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/fuzz/" in str(item.fspath):
            item.add_marker(pytest.mark.fuzz)
            if PROFILE == "long":
                item.add_marker(pytest.mark.timeout(1800))  # a long run's target takes minutes, past the suite's 300 s
