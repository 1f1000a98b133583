"""tests/conftest.py's xdist units name tests that exist: a renamed test would silently leave
its unit and run last (a cold inductor compile or a long warm-up at the end of the run)."""

import importlib

import pytest

from conftest import SCHEDULED_FIRST


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
