"""The mesh's model, projection, advice and CLI, on synthetic summaries of known figures
(the real runs that produce such summaries: tests/test_collectives.py)."""

from __future__ import annotations

import copy
import json

import pytest

from dtprofile.analysis.advice import analyze
from dtprofile.analysis.mesh_plan import mesh_shape, parse_mesh, replica_view, ring_share, tp_what_if
from dtprofile.analysis.projection import DEFAULT_INTRA_NODE_BANDWIDTH_Bps, project_summary
from dtprofile.cli import main
from dtprofile.render.terminal import format_projection


def _dim(label, size, role, slot):
    return {"label": label, "name": label, "size": size, "role": role, "slot": slot}


def _entry(role, size, waited, total, nbytes, kinds):
    return {
        "size": size,
        "role": role,
        "total": {"count": 2.0, "bytes": nbytes, "total_ms": total, "waited_ms": waited},
        "kinds": {
            k: {
                "count": 2.0 / len(kinds),
                "bytes": nbytes / len(kinds),
                "total_ms": total / len(kinds),
                "waited_ms": waited / len(kinds),
                "phases": {},
            }
            for k in kinds
        },
    }


def tp_summary(tp_waited=2.0, kinds=("all_reduce",), ranks_per_host=None, dp=None):
    """A TP (or, with ``dp``, an FSDP2 x TP) run: forward 3 + backward 4 + optimizer 0.5 ms of
    compute, data 0.5 ms, the TP group's waits ``tp_waited`` ms (and the DP dimension's 3 ms)."""
    dims = [_dim("tp", 2, "tp", "d0")]
    by_dim = {"tp": _entry("tp", 2, tp_waited, tp_waited + 1.0, 8192.0, kinds)}
    exposed, total, world = tp_waited, tp_waited + 1.0, 2
    if dp:
        dims = [_dim("dp", dp, "fsdp", "d0"), _dim("tp", 2, "tp", "d1")]
        by_dim["dp"] = _entry("fsdp", dp, 3.0, 3.0, 1e6, ("all_gather", "reduce_scatter"))
        exposed, total, world = exposed + 3.0, total + 3.0, 2 * dp
    step = 7.5 + 0.5 + exposed
    return {
        "world_size": world,
        "device": "cuda",
        "backend": "nccl",
        "comm_source": "fsdp" if dp else "dtensor",
        "grad_bytes": 5e5 if dp else None,
        "per_step_ms": {
            "step": step,
            "data_wait": 0.5,
            "forward": 3.0,
            "backward": 4.0,
            "optimizer": 0.5,
            "compute": 7.5,
            "comm_exposed": exposed,
            "comm_total": total,
            "overhead": 0.5 + exposed,
        },
        "ratios": {"R_O": (0.5 + exposed) / 7.5, "comm_fraction": exposed / step},
        "run": {"local_trainable_param_bytes": 4e6, "batch_size": 16, "ranks_per_host": ranks_per_host},
        "options": {"link_bandwidth_Bps": 12.5e9, "project_gpus": [1, 2, 4, 8]},
        "mesh": {"dims": dims},
        "comm_by_dim": by_dim,
    }


def test_a_mesh_is_replicas_of_the_tensor_parallel_degree():
    shape = mesh_shape(tp_summary(dp=4))
    assert (shape.world, shape.tp, shape.replicas, shape.tp_stride) == (8, 2, 4, 1)
    assert shape.tp_comm_waited_ms == 2.0 and shape.dp_comm_waited_ms == 3.0
    assert not shape.crosses_nodes(gpus_per_node=8) and shape.crosses_nodes(tp=16, gpus_per_node=8)
    # TP outermost: its ranks lie a whole dp apart.
    outer = tp_summary(dp=4)
    outer["mesh"]["dims"].reverse()
    assert mesh_shape(outer).tp_stride == 4 and mesh_shape(outer).crosses_nodes(gpus_per_node=4)
    assert mesh_shape({"mesh": {"dims": [_dim("dp", 8, "fsdp", "d0")]}}) is None  # (no TP: G is the world)
    assert mesh_shape({"world_size": 2}) is None


def test_the_replica_view_keeps_the_tensor_parallel_waits_out_of_what_crosses_replicas():
    s = tp_summary(dp=2)
    view = replica_view(s, mesh_shape(s))
    assert view["world_size"] == 2 and view["grad_bytes"] == 5e5
    assert view["per_step_ms"]["comm_exposed"] == 3.0 and view["per_step_ms"]["comm_total"] == 3.0
    assert view["busbw_GBps"] == pytest.approx(5e5 / 3e-3 / 1e9 * ring_share(2))
    only_tp = replica_view(tp_summary(), mesh_shape(tp_summary()))
    assert only_tp["grad_bytes"] == 4e6 and only_tp["per_step_ms"]["comm_exposed"] == 0.0  # (the shard's)
    assert only_tp["busbw_GBps"] is None  # (nothing measured across replicas)


def test_the_projection_grows_replicas_with_the_tensor_parallel_cost_fixed():
    s = tp_summary(tp_waited=2.0)
    p = project_summary(s)
    assert p["measured_gpus"] == 1 and p["gpus"] == [1, 2, 4, 8]
    assert p["mesh"]["gpus_total"] == [2, 4, 8, 16] and p["mesh"]["tp_comm_ms"] == 2.0
    # One replica: the measured step (compute, data, the TP waits); more: + the shard's all-reduce.
    assert p["step_ms"][0] == pytest.approx(s["per_step_ms"]["step"])
    ring = [1e3 * ring_share(g) * 4e6 / 12.5e9 for g in (1, 2, 4, 8)]
    for step, wire in zip(p["step_ms"], ring, strict=True):
        assert step == pytest.approx(s["per_step_ms"]["step"] + wire)
    # Strong scaling: the activations shrink with the per-replica batch, and so do their waits.
    strong = project_summary(s, scaling="strong", gpus=[1, 2])
    assert strong["step_ms"][1] < strong["step_ms"][0]


def test_another_tensor_parallel_degree_moves_compute_and_collectives():
    s = tp_summary(tp_waited=2.0)
    one = project_summary(s, tp=1, gpus=[1])
    assert one["mesh"]["tp_comm_ms"] == 0.0
    assert one["step_ms"][0] == pytest.approx(2 * 7.5 + 0.5)  # the whole replica's compute on one GPU
    four = project_summary(s, tp=4, gpus=[1], gpus_per_node=8)
    assert four["mesh"]["tp_comm_ms"] == pytest.approx(2.0 * 1.5) and not four["mesh"]["tp_crosses_nodes"]
    across = project_summary(s, tp=4, gpus=[1], gpus_per_node=2)
    # Across nodes: the intra-node link's rate (none discovered: the assumed 25 GB/s) over the link's.
    assert across["mesh"]["tp_crosses_nodes"]
    assert across["mesh"]["tp_comm_ms"] == pytest.approx(3.0 * DEFAULT_INTRA_NODE_BANDWIDTH_Bps / 12.5e9)
    assert tp_what_if(mesh_shape(s), 4) == (0.5, 1.5)
    with pytest.raises(ValueError, match="no tensor-parallel mesh dimension"):
        project_summary({"world_size": 2, "per_step_ms": {"step": 1.0}}, tp=2)


def test_mesh_advice_speaks_of_tensor_parallelism_not_of_ddp():
    ids = lambda s: {f["id"]: f for f in analyze(copy.deepcopy(s))["advice"]}  # noqa: E731
    exposed = ids(tp_summary(tp_waited=4.0))
    finding = exposed["tp_comm_exposed"]
    assert finding["severity"] == "high" and "SequenceParallel" in finding["action"]
    assert "comm_bound" not in exposed and "accumulation_sync" not in exposed
    assert finding["evidence"]["per_gpu_throughput_at_half_tp"] > 0
    sequence = ids(tp_summary(tp_waited=1.5, kinds=("all_gather", "reduce_scatter")))["tp_comm_exposed"]
    assert sequence["severity"] == "medium" and "SequenceParallel" not in sequence["action"]
    assert "tp_comm_exposed" not in ids(tp_summary(tp_waited=0.5))
    assert "tp_across_nodes" not in exposed
    outer = tp_summary(dp=4, ranks_per_host=4)
    outer["mesh"]["dims"].reverse()
    across = ids(outer)
    assert across["tp_across_nodes"]["severity"] == "high" and "innermost" in across["tp_across_nodes"]["action"]
    assert across["dp_comm_exposed"]["evidence"]["replicas"] == 4 and "HSDP" in across["dp_comm_exposed"]["action"]


def test_project_mesh_on_the_command_line(capsys, tmp_path):
    summary = tp_summary()
    summary.update(schema="dtprofile.summary/1", complete=True)
    (tmp_path / "dtprofile_summary.json").write_text(json.dumps(summary))
    assert main(["project", str(tmp_path), "--mesh", "dp=16,tp=4", "--gpus-per-node", "8", "--json"]) == 0
    proj = json.loads(capsys.readouterr().out)
    assert proj["mesh"]["tp"] == 4 and proj["mesh"]["gpus_total"][proj["gpus"].index(16)] == 64
    text = format_projection(proj)
    assert "replicas" in text.splitlines()[1] and "G = data-parallel replicas of 4 GPUs" in text
    assert main(["project", str(tmp_path), "--mesh", "tp=x"]) == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and "dp=N,tp=M" in err and err.count("\n") == 1
    assert parse_mesh("tp=2") == {"tp": 2}
    with pytest.raises(ValueError, match="dp=N,tp=M"):
        parse_mesh("pp=2")


def test_the_tab_names_the_mesh_its_dimensions_and_the_projections_axis(tmp_path):
    from dtprofile.dashboard.views import run_view

    summary = analyze(tp_summary(tp_waited=4.0))
    summary.update(schema="dtprofile.summary/1", complete=True)
    (tmp_path / "tp").mkdir()
    (tmp_path / "tp" / "dtprofile_summary.json").write_text(json.dumps(summary))
    view = run_view(str(tmp_path), "tp")
    assert view["verdict"]["id"] == "tp_comm_exposed"
    assert view["comm"]["mesh"] == "mesh tp=2 (tp)"
    (line,) = view["comm"]["by_dim"]
    assert line.startswith("tp:") and "all_reduce" in line and "4" in line
    assert view["scaling"]["axis"] == "replicas (of 2 GPUs)"
    assert "G = data-parallel replicas of 2 GPUs" in view["scaling"]["caption"]


def test_the_scalars_hold_each_dimensions_collectives():
    from dtprofile.sinks.tags import scalars_from_summary

    tags = scalars_from_summary(tp_summary(dp=2))
    assert tags["dtprofile/mesh/tp/waited_ms"] == 2.0 and tags["dtprofile/mesh/tp/total_ms"] == 3.0
    assert tags["dtprofile/mesh/dp/MB"] == 1.0 and tags["dtprofile/mesh/dp/all_gather/waited_ms"] == 1.5
    assert not [t for t in scalars_from_summary({"comm_by_dim": None}) if "/mesh/" in t]
