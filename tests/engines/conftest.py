"""The ``engine`` fixture: every feature's real-bytes test runs once per real engine.

A test that takes ``engine`` gets a :class:`support.engine_peers.Engine` for Mooncake (TCP on
127.0.0.1) and then for NIXL (UCX), with the engine's marker (``-m mooncake`` / ``-m nixl``
select them). A missing engine fails the test, never skips it: CI must run the real transfers.
Tests of one engine's own paths (Mooncake's native hand-off, NIXL's prepped descriptors) live in
test_mooncake.py, test_mooncake_native.py and test_nixl.py instead.
"""

from __future__ import annotations

import pytest

from support.engine_peers import ENGINE_HANDLES, Engine


@pytest.fixture(params=[pytest.param(name, marks=getattr(pytest.mark, name))
                        for name in ENGINE_HANDLES])
def engine(request: pytest.FixtureRequest) -> Engine:
    handle = ENGINE_HANDLES[request.param]
    handle.require()
    return handle
