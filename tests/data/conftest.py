"""Fixtures of the data tests."""

from __future__ import annotations

import pytest

from workbench.data.loader import resolve
from workbench.data.prepared import PreparedDataset


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Raw tmp datasets are prepared into a tmp cache (the bundled sets keep the shared one)."""
    monkeypatch.setenv("WORKBENCH_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bundled():
    """The bundled chat set, prepared once into the shared data cache (as training.dataset = "chitchat" does)."""
    return PreparedDataset(resolve("chitchat", progress=False))
