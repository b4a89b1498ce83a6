"""Options is the one definition: profile(), the callback and DTPROFILE_* derive from it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import dtprofile
from dtprofile.options import (
    OPTION_NAMES,
    Options,
    env_parser,
    env_variables,
    options_doc,
    options_from_env,
    options_from_kwargs,
)


def test_profile_and_the_callback_take_exactly_the_options():
    fields = [f.name for f in dataclasses.fields(Options) if f.init]
    assert list(OPTION_NAMES) == fields
    params = inspect.signature(dtprofile.profile).parameters
    assert list(params)[2:] == fields and all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in fields)
    assert [params[n].default for n in fields] == [f.default for f in dataclasses.fields(Options) if f.init]
    callback = inspect.signature(dtprofile.DTProfileCallback).parameters
    assert list(callback) == fields and callback["every_n_steps"].default is None  # the Trainer's interval


def test_every_option_has_a_variable_a_parser_and_documentation():
    assert env_variables() == {"DTPROFILE_" + n.upper(): n for n in OPTION_NAMES}
    for name in OPTION_NAMES:
        assert callable(env_parser(name))
        assert f"``{name}``" in options_doc()
    assert options_from_env({"DTPROFILE_LINK_BANDWIDTH_PER": " gpu "}) == {"link_bandwidth_per": "gpu"}


def test_an_unknown_option_is_named_in_one_line_with_the_accepted_ones():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as info:
        dtprofile.profile(model, opt, warmup=3)
    text = str(info.value)
    assert "\n" not in text and "'warmup'" in text and "warmup_steps" in text
    with pytest.raises(TypeError, match="DTProfileCallback\\(\\) got an unexpected option 'logdirr'"):
        dtprofile.DTProfileCallback(logdirr="x")
    assert options_from_kwargs("x()", {"warmup_steps": 2}).warmup_steps == 2


def test_link_bandwidth_per_is_checked():
    assert Options(link_bandwidth_per="gpu").link_bandwidth_per == "gpu"
    with pytest.raises(ValueError, match="link_bandwidth_per must be one of \\('node', 'gpu'\\)"):
        Options(link_bandwidth_per="rack")


def test_every_variable_and_option_is_documented():
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    lightning, loops = (docs / "lightning.md").read_text(), (docs / "custom-loops.md").read_text()
    for var, name in env_variables().items():
        assert f"`{var}`" in lightning, var
        assert f"`{name}`" in loops, name
