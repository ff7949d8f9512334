"""The reliability world for the short, in-`make test` versions of the scenarios: built once per test
process (each xdist worker builds its own, in a few seconds)."""

from __future__ import annotations

import pytest

from tests.reliability.world import build_world


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    world = build_world(tmp_path_factory.mktemp("reliability-world"))
    world.baseline  # noqa: B018 (built now): the uninterrupted extraction every kill is compared with
    return world
