"""The analysis stage: a run summary in, its projection, recommendations and advice out.

Pure code on plain numbers and summaries (``docs/summary.md``): no I/O and no torch
code of its own, so every part is testable without a training run.

- :mod:`~dtprofile.analysis.perf_model`: the paper's formulas (alpha, projected speedup)
  and the communication cost models (ring and two-level all-reduce, parameter servers,
  the bandwidth a target needs), link-speed parsing;
- :mod:`~dtprofile.analysis.phases`: the measured step split by how each part scales,
  and its refined projection;
- :mod:`~dtprofile.analysis.projection`: summary -> ``projection``;
- :mod:`~dtprofile.analysis.recommendations`: summary + projection -> ``recommendations``;
- :mod:`~dtprofile.analysis.sizing`: batch that fits, DataLoader workers, critical batch;
- :mod:`~dtprofile.analysis.advice`: summary -> ``advice``, the findings of one registry
  of rules (``analyze`` fills projection, recommendations and advice at once);
- :mod:`~dtprofile.analysis.compare`: two summaries side by side;
- :mod:`~dtprofile.analysis.summary_readers` and :mod:`~dtprofile.analysis.checks`: the
  figures and argument checks the others share.

"Model" in dtprofile means the user's ``nn.Module``; the performance model is
``perf_model``.
"""
