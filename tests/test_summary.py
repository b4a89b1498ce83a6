"""The summary file: written atomically, read back with one-line errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dtprofile.summary import SCHEMA, Report, SummaryError, load_summary, write_summary

DATA = Path(__file__).parent / "data" / "summary_2rank.json"


def test_a_written_summary_reads_back(tmp_path):
    summary = json.loads(DATA.read_text())
    write_summary(summary, str(tmp_path / "s.json"))
    assert load_summary(str(tmp_path / "s.json")) == summary


@pytest.mark.parametrize(
    "text, words",
    [
        (
            '{"schema": "dtprofile.summary/2"}',
            'summary schema "dtprofile.summary/2", this dtprofile reads "dtprofile.summary/1"',
        ),
        ('{"schema": "other/1"}', 'not a dtprofile summary ("schema": "other/1"; expected "dtprofile.summary/1")'),
        ('{"schema": 3}', 'not a dtprofile summary ("schema": 3; expected "dtprofile.summary/1")'),
        ('{"per_step_ms": {}}', 'not a dtprofile summary (no "schema"'),
        ("[1, 2]", "not a dtprofile summary (an array, expected an object"),
        ("null", "not a dtprofile summary (null, expected an object"),
        ('{"schema": "dtprofile.summ', "not valid JSON (Unterminated string starting at: line 1 column 12)"),
    ],
)
def test_what_is_not_a_summary_this_dtprofile_reads_is_one_line_naming_the_file(tmp_path, text, words):
    path = tmp_path / "dtprofile_summary.json"
    path.write_text(text)
    with pytest.raises(SummaryError) as info:
        load_summary(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message
    assert isinstance(info.value, ValueError)


def test_a_missing_file_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_summary(str(tmp_path / "nope.json"))


def test_report_wraps_the_summary_it_was_given():
    summary = {"schema": SCHEMA, "world_size": 2, "per_step_ms": {"step": 1.0}, "ratios": {"R_O": 0.5}}
    report = Report(summary)
    assert report.to_dict() is summary and report["world_size"] == 2
    assert report.per_step_ms == {"step": 1.0} and report.ratios == {"R_O": 0.5} and report.advice == []
    assert repr(report) == "<dtprofile.Report world_size=2 R_O=0.5>"
    with pytest.raises(TypeError, match="summary must be a dict"):
        Report([summary])


def test_the_former_module_paths_still_import_the_same_objects():
    """report, tensorboard, plots and background re-export what other code imports (and
    warn that they are deprecated: tests/test_public_surface.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from dtprofile import background, plots, report, tensorboard
    from dtprofile import render, summary
    from dtprofile.sinks import background as sink_background
    from dtprofile.sinks import plots as sink_plots
    from dtprofile.sinks import tensorboard as sink_tensorboard

    for old, new in (
        (report, summary),
        (tensorboard, sink_tensorboard),
        (plots, sink_plots),
        (background, sink_background),
    ):
        for name in old.__all__:
            assert getattr(old, name) is (getattr(new, name, None) or getattr(render, name)), (old.__name__, name)
    assert report.write_summary_with_reserve is summary.write_summary_with_reserve
    assert report.reserve_summary_space is summary.reserve_summary_space
    assert report.PEER_WAIT_MIN_MS == summary.PEER_WAIT_MIN_MS
    assert tensorboard.fmt is render.fmt and tensorboard.measurement_notes is render.measurement_notes
