"""The TensorBoard tab, served by the installed dtprofile (.ci/wheel).

Usage: python .ci/check_tab.py LOGDIR SOURCE_STATIC_DIR, run from outside the repository
in the environment the wheel went into, after ``dtprofile demo`` wrote a run (or two)
under LOGDIR. TensorBoard finds the plugin through its ``tensorboard_plugins`` entry point,
as ``tensorboard --logdir`` does; every route must answer 200 with a body. Exits non-zero
on the first failure.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from urllib.parse import urlencode

import dtprofile

logdir, source_static = Path(sys.argv[1]), Path(sys.argv[2])
PREFIX = "/data/plugin/dtprofile"


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"check_tab: {what}")


# The installed package, not a source tree.
package = Path(dtprofile.__file__).resolve().parent
site = Path(sysconfig.get_paths()["purelib"]).resolve()
check(package.parent == site, f"dtprofile imported from {package}, not from {site}")
version = metadata.version("dtprofile")
check(dtprofile.__version__ == version, f"dtprofile.__version__ {dtprofile.__version__!r}, installed {version!r}")
installed_static = package / "dashboard" / "static"
for path in sorted(source_static.iterdir()):
    if path.is_file():
        copy = installed_static / path.name
        check(copy.is_file() and copy.read_bytes() == path.read_bytes(), f"{copy}: not installed as in the source")

from tensorboard import default, program  # noqa: E402
from tensorboard.backend import application  # noqa: E402
from werkzeug.test import Client  # noqa: E402

tb = program.TensorBoard(plugins=default.get_plugins())
tb.configure(argv=["", "--logdir", str(logdir), "--load_fast", "false", "--reload_interval", "0"])
provider, multiplexer = tb._make_data_provider()
client = Client(
    application.TensorBoardWSGIApp(tb.flags, tb.plugin_loaders, provider, tb.assets_zip_provider, multiplexer)
)


def get(path: str, **query: str) -> bytes:
    url = f"{path}?{urlencode(query)}" if query else path
    response = client.get(url)
    body = response.get_data()
    check(response.status_code == 200, f"{url}: {response.status_code} {body[:500]!r}")
    check(len(body) > 0, f"{url}: an empty body")
    print(f"  {url}: 200, {len(body)} bytes")
    return body


def get_json(path: str, **query: str) -> dict:
    answer = json.loads(get(path, **query))
    check(isinstance(answer, dict) and "error" not in answer, f"{path} {query}: {str(answer)[:500]}")
    return answer


listing = get_json("/data/plugins_listing")
tab = listing.get("dtprofile") or {}
check(tab.get("enabled") is True, f"the dtprofile tab is not listed as enabled: {tab}")
module = tab.get("loading_mechanism", {}).get("module_path")
check(module == f"{PREFIX}/index.js", f"the tab's module path: {module!r}")
js = get(module)
check(js == (source_static / "index.js").read_bytes(), "index.js served is not the source's")
check(b"export async function render" in js, "index.js: no render()")

runs = get_json(f"{PREFIX}/runs")
names = [r["run"] for r in runs["runs"]]
check(len(names) >= 2 and all(r["complete"] for r in runs["runs"]) and not runs.get("errors"), f"/runs: {runs}")
for name in names:
    view = get_json(f"{PREFIX}/run", run=name)
    check(bool(view.get("verdict")) and view["step"]["step_ms"] > 0, f"/run?run={name}: {str(view)[:500]}")
    check(
        json.loads((logdir / name / "dtprofile_summary.json").read_text())["dtprofile_version"] == version,
        f"{name}: the summary's dtprofile_version is not {version}",
    )
projected = get_json(f"{PREFIX}/project", run=names[0], gpus="1,2,8", bandwidth="10Gbit")
check(projected["scaling"]["gpus"] == [1, 2, 8], f"/project: {str(projected)[:500]}")
compared = get_json(f"{PREFIX}/compare", baseline=names[0], candidate=names[1])
check(compared["per_step_ms"]["step"]["candidate"] > 0, f"/compare: {str(compared)[:500]}")
print(f"the tab's routes answer, from dtprofile {version} in {package}")
