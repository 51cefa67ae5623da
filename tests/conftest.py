"""Test selection: `slow` runs stay out unless the marker expression names them.

pyproject's addopts selects `-m 'not slow'`, but a `-m` on the command line replaces it: `pytest -m gpu` would run the
GPU tier's slow cases too (a cold compile each, minutes on a GPU whose time is rationed). Here a marker expression
that does not mention `slow` also leaves the slow tests out: `-m gpu` is the GPU tier's default set, `-m "gpu and
slow"` the rest of it, `-m slow` every slow test.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
