"""Every runnable example in a docstring runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "dtprofile",
    "dtprofile.advice",
    "dtprofile.background",
    "dtprofile.capture.ddp",
    "dtprofile.console",
    "dtprofile.compare",
    "dtprofile.capture.fsdp",
    "dtprofile.model",
    "dtprofile.capture.records",
    "dtprofile.report",
    "dtprofile.capture.clocks",
    "dtprofile.integrations.torch",
    "dtprofile.options",
    "dtprofile.engine",
    "dtprofile.capture.steps",
    "dtprofile.capture.data_wait",
    "dtprofile._values",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
