"""Every runnable example in a docstring runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "dtprofile",
    "dtprofile._values",
    "dtprofile.advice",
    "dtprofile.cli",
    "dtprofile.comm",
    "dtprofile.console",
    "dtprofile.compare",
    "dtprofile.demo",
    "dtprofile.fsdp",
    "dtprofile.model",
    "dtprofile.recorder",
    "dtprofile.render",
    "dtprofile.render.markdown",
    "dtprofile.render.numbers",
    "dtprofile.render.terminal",
    "dtprofile.render.views",
    "dtprofile.sinks.background",
    "dtprofile.sinks.tensorboard",
    "dtprofile.summary",
    "dtprofile.timing",
    "dtprofile.integrations.torch",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
