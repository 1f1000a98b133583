"""tests/conftest.py's xdist units name tests and files that exist: a renamed test would
silently leave its unit and run last (a cold inductor compile or a long warm-up at the end of
the run), a renamed file would run in collection order (late, for most of them)."""

import importlib
from pathlib import Path

import pytest

from conftest import SCHEDULED_FIRST, SENT_EARLY


@pytest.mark.parametrize("nodeid", list(SCHEDULED_FIRST))
def test_each_scheduled_test_exists(nodeid):
    path, name = nodeid.split("::")
    function, _, param = name.partition("[")
    module = importlib.import_module(path.removeprefix("tests/").removesuffix(".py"))
    test = getattr(module, function, None)
    assert callable(test), f"{path} has no {function}"
    if param:  # one parametrize mark, its values the ids
        values = [v for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize"
                  for v in mark.args[1]]
        assert param.removesuffix("]") in map(str, values), (nodeid, values)


@pytest.mark.parametrize("path", SENT_EARLY)
def test_each_file_sent_early_exists(path):
    assert (Path(__file__).parent.parent / path).is_file(), path
