"""The dtprofile tab in TensorBoard.

:mod:`.views` builds what the tab shows as JSON from the runs under a log directory
(framework-free, tested without TensorBoard); :mod:`.plugin` serves it, and the ES
module ``static/index.js`` draws it (plain JavaScript and SVG, nothing fetched from the
network). TensorBoard finds the plugin through the ``tensorboard_plugins`` entry point.
"""
