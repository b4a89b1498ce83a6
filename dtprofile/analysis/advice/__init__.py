"""The advice: rules that turn a run summary into findings (pure functions, no torch).

A finding (:class:`~dtprofile.analysis.advice.registry.Finding`) has a stable ``id``, a
``severity`` (``high`` > ``medium`` > ``low`` > ``info``), a one-line ``title``, the
``evidence`` (the measured numbers that triggered it), the ``action`` (which argument to
change, to what) and the ``expected_gain`` (the performance model's estimate, or None).
:func:`advise` returns them most severe first; :func:`analyze` fills a summary's
``projection``, ``recommendations`` and ``advice``; :func:`format_findings` renders them
for a terminal. Every finding comes from one registered rule
(:mod:`~dtprofile.analysis.advice.registry`), and every threshold is defined once, with
its source, in :mod:`~dtprofile.analysis.advice.thresholds`.

The rules, by concern: :mod:`~dtprofile.analysis.advice.data` (identical data, data
wait), :mod:`~dtprofile.analysis.advice.comm` (communication, accumulation),
:mod:`~dtprofile.analysis.advice.stragglers`, :mod:`~dtprofile.analysis.advice.scaling`
(link bandwidth, device count, parameter servers), :mod:`~dtprofile.analysis.advice.mesh`
(tensor parallelism, a 2-D mesh's data-parallel dimension),
:mod:`~dtprofile.analysis.advice.pipeline` (the bubble, unequal stages), :mod:`~dtprofile.analysis.advice.batch`
(memory and batch), :mod:`~dtprofile.analysis.advice.compute` (launch-bound, optimizer,
host work, threads, cuDNN) and :mod:`~dtprofile.analysis.advice.run_health` (too little
data, steps that differ or update nothing, and the ``healthy`` verdict).

Rules never raise on a well-formed summary with missing measurements (nulls anywhere,
zero steps, world_size 1): a rule without its numbers stays silent.

Adding a rule:

1. Write one function in the module of its concern, taking the summary's
   :class:`~dtprofile.analysis.advice.readings.Readings` and returning a
   :class:`~dtprofile.analysis.advice.registry.Finding` with the rule's id, or None when
   it has nothing to say (or lacks its numbers)::

       @rule("my_finding", order=1250)
       def my_finding(r: Readings) -> Finding | None:
           if r.step is None or r.optimizer is None or r.optimizer < MY_THRESHOLD * r.step:
               return None
           return Finding("my_finding", "low", "...", {"optimizer_ms": r.optimizer}, "...")

2. Register it with :func:`~dtprofile.analysis.advice.registry.rule`, as above: ``order``
   places it among findings of the same severity (the rules use multiples of 100; pick a
   free number between two). A rule in a new module needs that module imported below.
3. Define its thresholds in :mod:`~dtprofile.analysis.advice.thresholds`, each with a
   comment saying where the number comes from.
4. Test it in ``tests/test_advice.py``, and give its id a row in ``docs/advice.md`` (a
   test checks that every registered id is documented).

Example:
    >>> s = {"per_step_ms": {"step": 100.0, "data_wait": 40.0, "compute": 60.0}, "world_size": 1}
    >>> [(f["id"], f["severity"]) for f in advise(s)][:1]
    [('data_bound', 'high')]
"""

from __future__ import annotations

# Importing the rule modules registers their rules, in the order of their ``order``.
from . import batch, comm, compute, data, mesh, pipeline, run_health, scaling, stragglers  # noqa: F401
from .findings import advise, analyze, format_findings, json_safe
from .registry import SEVERITY_ORDER, Finding, Rule, rule, rules
from .wording import fsdp_collectives

__all__ = [
    "SEVERITY_ORDER",
    "Finding",
    "Rule",
    "advise",
    "analyze",
    "format_findings",
    "fsdp_collectives",
    "json_safe",
    "rule",
    "rules",
]
