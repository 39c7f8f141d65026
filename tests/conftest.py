"""Session-wide test settings."""
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache_in_tmp(tmp_path_factory):
    """Pass-cost calibrations (calibrate.py) of the tests' models go to a temporary folder, never to
    the user's ~/.cache/prove-local (subprocesses inherit the variable)."""
    old = os.environ.get("PROVE_LOCAL_CACHE")
    os.environ["PROVE_LOCAL_CACHE"] = str(tmp_path_factory.mktemp("prove-local-cache"))
    yield
    if old is None:
        os.environ.pop("PROVE_LOCAL_CACHE", None)
    else:
        os.environ["PROVE_LOCAL_CACHE"] = old
