"""Run one of examples/ as its ``__main__``, unchanged, and have each rank say it finished.

For tests/test_launch.py::

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT \\
        run_example.py OUTDIR examples/custom_loop_ddp.py --steps 20 --logdir LOGDIR

torchrun runs this file on every rank; it runs the example as torchrun would have run it
(``runpy.run_path(..., run_name="__main__")``, the example's own arguments in
``sys.argv``), keeping each ``dtprofile.profile(...)`` the example makes. Once the
example has returned (its process group destroyed), the rank writes
``OUTDIR/rank<R>.json``: its rank, "finished", and figures from its own final report.
Then the interpreter ends as it would have after the example alone.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import dtprofile


def main() -> int:
    outdir, example, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    made = []
    profile = dtprofile.profile

    def kept(*a, **kw):
        prof = profile(*a, **kw)
        made.append(prof)
        return prof

    dtprofile.profile = kept  # the example calls dtprofile.profile(...) through the module
    sys.argv = [example, *args]
    runpy.run_path(example, run_name="__main__")
    rank = int(os.environ["RANK"])
    summaries = [p.report().to_dict() for p in made]
    record = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "pid": os.getpid(),
        "status": "finished",
        "profiles": len(made),
        "summary": {
            "steps_total": summaries[-1]["steps_total"],
            "world_size": summaries[-1]["world_size"],
            "comm_source": summaries[-1]["comm_source"],
            "step_ms": summaries[-1]["per_step_ms"]["step"],
        }
        if summaries
        else None,
    }
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
