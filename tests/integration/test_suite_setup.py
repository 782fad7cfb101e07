"""The suite's own set-up: what it leaves on disk."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
from helpers import SUITE_DISK_GB, disk_header


def test_a_passing_tests_tmp_path_is_removed_when_it_ends(pytestconfig: pytest.Config) -> None:
    """CI once ran out of disk with every tmp_path of the run kept to its end (about 30 GB):
    setup.cfg's retention policy removes a passing test's folder as soon as it ends and
    keeps a failing one's for inspection."""
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"


def test_the_report_header_warns_when_the_disk_is_nearly_full(monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 0, 50 * 2**30))
    assert disk_header().startswith("disk: 50.0 GB free in ")
    assert "less than" not in disk_header()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 0, 2**29))
    header = disk_header()
    assert header.startswith("disk: 0.5 GB free in ")
    assert f"less than the {SUITE_DISK_GB} GB" in header and "--basetemp" in header
