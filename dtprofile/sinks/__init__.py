"""Where a summary goes once it is built: sinks write, they do not compose text.

- :mod:`.tags`: what is written, by name: the tags, a summary's scalars, the
  custom-scalars layout.
- :mod:`.tensorboard`: :class:`~dtprofile.sinks.tensorboard.TensorBoardSink`, which writes
  them, the Markdown report (:func:`dtprofile.render.advice_markdown`) and images.
- :mod:`.plots`: the images, with matplotlib (optional).
- :mod:`.background`: :class:`~dtprofile.sinks.background.BackgroundWorker`, the one
  thread off the training thread where log intervals are summarised and written, at a
  bounded share of wall time (:class:`~dtprofile.sinks.background.BackgroundSink`: a
  sink's writes alone).

Nothing is imported here: a sink's module (and what it needs) loads when it is used.
"""

__all__: list[str] = []
