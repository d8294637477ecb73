"""The C ABI's library, loaded once per test module (``support.capi.load``)."""

from __future__ import annotations

import ctypes

import pytest

from support.capi import load


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load()
