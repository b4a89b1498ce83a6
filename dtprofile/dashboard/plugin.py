"""The TensorBoard plugin: the dtprofile tab's routes and its ES module.

Installed with dtprofile through the ``tensorboard_plugins`` entry point. TensorBoard
loads ``/index.js`` in an iframe whose base is ``/data/plugin/dtprofile/``, so the
module's relative requests reach the routes below. Every route answers JSON; a request
it cannot answer gets ``{"error": "..."}`` with status 400 (a bad value, a missing run)
or 500 (anything else), never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from ..analysis.advice import json_safe
from ..runs import walk_logdir
from ..summary_file import SUMMARY_NAME
from . import views

log = logging.getLogger(__name__)

__all__ = ["DTProfilePlugin"]

PLUGIN_NAME = "dtprofile"
_STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# is_active() walks at most this many directories looking for a summary.
_ACTIVE_WALK_LIMIT = 2000
# werkzeug's Request.application, typed for a plain function of the request: it passes a
# method's self through as well, which is how the routes below use it.
_application: Callable[[Callable[..., Any]], Any] = wrappers.Request.application


def _json(request: Any, body: Any, code: int = 200) -> Any:
    # Non-finite floats as null: strict JSON, which browsers parse.
    return http_util.Respond(request, json.dumps(json_safe(body), allow_nan=False), "application/json", code=code)


class DTProfilePlugin(base_plugin.TBPlugin):
    """The dtprofile tab: the verdict, the step per rank, scaling and what-ifs for a run."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._logdir: str | None = getattr(context, "logdir", None)
        self._data_provider = getattr(context, "data_provider", None)
        self._active = False

    # ------------------------------------------------------------------ TBPlugin
    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        return {
            "/index.js": self._serve_index,
            "/runs": self._serve_runs,
            "/run": self._serve_run,
            "/project": self._serve_project,
            "/compare": self._serve_compare,
        }

    def is_active(self) -> bool:
        """A dtprofile run under the log directory: a summary file, or ``dtprofile/``
        scalars (a run still going)."""
        if self._active:
            return True  # (runs do not leave a log directory while TensorBoard reads it)
        self._active = self._has_summary() or self._has_scalars()
        return self._active

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="dtprofile")

    # ------------------------------------------------------------------ activity
    def _has_summary(self) -> bool:
        if not self._logdir or not os.path.isdir(self._logdir):
            return False
        for seen, (_, filenames) in enumerate(walk_logdir(self._logdir)):
            if SUMMARY_NAME in filenames:
                return True
            if seen >= _ACTIVE_WALK_LIMIT:
                break
        return False

    def _has_scalars(self) -> bool:
        provider = self._data_provider
        if provider is None:
            return False
        try:
            from tensorboard import context as tb_context

            runs = provider.list_scalars(tb_context.RequestContext(), experiment_id="", plugin_name="scalars")
        except Exception as exc:  # a provider without scalars: the summary walk decides
            log.debug("dtprofile: scalars not listed: %r", exc)
            return False
        return any(tag.startswith("dtprofile/") for tags in runs.values() for tag in tags)

    # ------------------------------------------------------------------ routes
    def _answer(self, request: Any, build: Callable[[str], Any]) -> Any:
        """``build(logdir)``'s answer as JSON; an error's, one line, with its status."""
        logdir = self._logdir
        if not logdir:
            return _json(request, {"error": "TensorBoard was started without --logdir"}, 400)
        try:
            return _json(request, build(logdir))
        except views.ViewError as exc:
            return _json(request, {"error": str(exc)}, 400)
        except Exception as exc:  # a malformed run must not break the tab
            log.warning("dtprofile tab: %s failed", request.path, exc_info=True)
            return _json(request, {"error": f"dtprofile could not answer this ({type(exc).__name__}: {exc})"}, 500)

    @_application
    def _serve_index(self, request: Any) -> Any:
        with open(os.path.join(_STATIC, "index.js"), encoding="utf-8") as fh:
            return http_util.Respond(request, fh.read(), "application/javascript")

    @_application
    def _serve_runs(self, request: Any) -> Any:
        return self._answer(request, views.run_index)

    @_application
    def _serve_run(self, request: Any) -> Any:
        run = request.args.get("run")
        if not run:
            return _json(request, {"error": "run: missing (one of the names /runs lists)"}, 400)
        return self._answer(request, lambda logdir: views.run_view(logdir, run))

    @_application
    def _serve_project(self, request: Any) -> Any:
        args = request.args
        run = args.get("run")
        if not run:
            return _json(request, {"error": "run: missing (one of the names /runs lists)"}, 400)
        return self._answer(
            request,
            lambda logdir: views.project_view(
                logdir,
                run,
                gpus=args.get("gpus"),
                bandwidth=args.get("bandwidth"),
                nodes=args.get("nodes"),
                scaling=args.get("scaling"),
                batch=args.get("batch"),
            ),
        )

    @_application
    def _serve_compare(self, request: Any) -> Any:
        baseline, candidate = request.args.get("baseline"), request.args.get("candidate")
        if not baseline or not candidate:
            return _json(request, {"error": "baseline and candidate: both runs are needed"}, 400)
        return self._answer(request, lambda logdir: views.compare_view(logdir, baseline, candidate))
