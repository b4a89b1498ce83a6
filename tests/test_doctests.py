"""Every runnable example in a docstring runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "dtprofile",
    "dtprofile._values",
    "dtprofile.analysis.advice",
    "dtprofile.analysis.advice.findings",
    "dtprofile.analysis.advice.registry",
    "dtprofile.analysis.advice.wording",
    "dtprofile.analysis.checks",
    "dtprofile.analysis.compare",
    "dtprofile.analysis.mesh_comm",
    "dtprofile.analysis.mesh_plan",
    "dtprofile.analysis.perf_model",
    "dtprofile.analysis.phases",
    "dtprofile.analysis.pipeline_plan",
    "dtprofile.analysis.projection",
    "dtprofile.analysis.rank_spread",
    "dtprofile.analysis.recommendations",
    "dtprofile.analysis.sizing",
    "dtprofile.analysis.summary_readers",
    "dtprofile.analysis.uncertainty",
    "dtprofile.capture.clocks",
    "dtprofile.capture.data_wait",
    "dtprofile.capture.ddp",
    "dtprofile.capture.probe",
    "dtprofile.capture.fsdp",
    "dtprofile.capture.handoff",
    "dtprofile.capture.mesh_comm",
    "dtprofile.capture.pipeline",
    "dtprofile.capture.records",
    "dtprofile.capture.rows",
    "dtprofile.capture.windows",
    "dtprofile.capture.schedule",
    "dtprofile.capture.steps",
    "dtprofile.capture.tensors",
    "dtprofile.cli",
    "dtprofile.console",
    "dtprofile.dashboard.views",
    "dtprofile.demo",
    "dtprofile.engine",
    "dtprofile.options",
    "dtprofile.run_history",
    "dtprofile.render",
    "dtprofile.render.layout",
    "dtprofile.render.markdown",
    "dtprofile.render.numbers",
    "dtprofile.render.terminal",
    "dtprofile.render.views",
    "dtprofile.sinks.background",
    "dtprofile.sinks.tensorboard",
    "dtprofile.sinks.tags",
    "dtprofile.summary",
    "dtprofile.summary_file",
    "dtprofile.integrations.torch",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples to run"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
