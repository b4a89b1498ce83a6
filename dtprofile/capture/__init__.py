"""Capture: the hot path, and nothing else.

Framework events (module, autograd and optimizer hooks, DDP's communication hook, FSDP's
collectives, the loader) become marks on a clock and, once a step ends, a step record.
Nothing here builds summaries, gathers across ranks or writes files.

- :mod:`.clocks`: host and CUDA-event clocks (and a fake for tests);
- :mod:`.records`: a step's pending marks, its record, bounded windows;
- :mod:`.parts`: the parts an internal error can switch off, and the guard;
- :mod:`.steps`: open, close and drain steps; what is left out of them;
- :mod:`.schedule`: which steps probe, time each bucket, or time the passes;
- :mod:`.passes`: the hooks on the module, backward and the optimizer that feed steps;
- :mod:`.data_wait`: every data-wait measurement (the loader, the gap, transfers);
- :mod:`.comm`: one recorder for every communication source, fed by
  :mod:`.ddp` (the timed DDP hook) and :mod:`.fsdp` (FSDP's collectives);
- :mod:`.scaler`: the updates a loss scaler skipped;
- :mod:`.mesh`: a DTensor model's DeviceMesh, its dimensions and their roles;
  :mod:`.collectives`: every collective on it timed per dimension, kind and phase;
  :mod:`.mesh_comm`: the engine's part that puts them in the step and the rank's row.
"""
