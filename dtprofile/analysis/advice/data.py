"""Rules about the data: every rank on the same batches, and waiting for the next batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from ..._values import finite, get, median
from .readings import Readings
from .registry import Finding, rule, severity_band
from .thresholds import (
    DATA_BOUND_FRACTION,
    IDENTICAL_DATA_MAX_B,
    TRANSFER_BOUND_SHARE,
    UNEVEN_DATA_WAIT_MIN_MS,
    UNEVEN_DATA_WAIT_RATIO,
)
from .wording import borderline_severity, count_text, gain_text, job_words, noise_words, percent

__all__ = ["data_bound", "identical_data"]


@rule("identical_data", order=100)
def identical_data(r: Readings) -> Finding | None:
    """Several ranks and a gradient noise scale of ~0: every rank computed the same gradient.

    ``high``: G devices do the work of one; the action is a DistributedSampler.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    gns = get(r.run_info, "gradient_noise")
    b_simple, samples = finite(get(gns, "B_simple")), finite(get(gns, "samples"))
    if r.world_size < 2 or b_simple is None or not samples or abs(b_simple) >= IDENTICAL_DATA_MAX_B:
        return None
    g = int(r.world_size)
    evidence = {
        "B_simple": b_simple,
        "samples": int(samples),
        "world_size": g,
        "batch_size": r.batch_size,
        "threshold": IDENTICAL_DATA_MAX_B,
    }
    title = (
        f"Every rank computed the same gradient: the {g} ranks train on the same batches, "
        f"so {g} devices do the work of one"
    )
    action = (
        "give each rank its own share of the data: DataLoader(dataset, sampler="
        "torch.utils.data.distributed.DistributedSampler(dataset)) and "
        "sampler.set_epoch(epoch) every epoch (Lightning adds it unless "
        "use_distributed_sampler=False); an IterableDataset must split its stream by rank"
    )
    return Finding("identical_data", "high", title, evidence, action, f"{g}x distinct samples per step")


@rule("data_bound", order=200)
def data_bound(r: Readings) -> Finding | None:
    """Data wait at least :data:`DATA_BOUND_FRACTION` of the step: what to change in the loader.

    Severity by the wait's share of the step (:func:`severity_band`). The action depends on
    where the wait is: the batch's transfer to the device, too few workers, or a loader
    already at the CPU limit; without ``prof.loader`` it may be any host work.

    Args:
        r: The summary's readings.

    Returns:
        The finding, or None.
    """
    # Within the run's noise of the threshold: raised all the same, low, so that the same
    # job profiled again does not flip its verdict on noise (as comm_bound).
    borderline = r.data_bound_within_noise
    if not (r.data_bound or borderline) or r.step is None or r.data_wait is None or r.data_fraction is None:
        return None
    current = finite(get(r.run_info, "num_workers"))
    workers = finite(get(r.recommendations, "num_workers"))
    needed = finite(get(r.recommendations, "num_workers_needed"))
    cpus = finite(get(r.run_info, "cpus_per_rank"))
    evidence = {
        "data_wait_ms": r.data_wait,
        "step_ms": r.step,
        "data_fraction": r.data_fraction,
        "num_workers": current,
        "num_workers_needed": needed,
        "cpus_per_rank": cpus,
        "threshold": DATA_BOUND_FRACTION,
        "data_wait_source": get(r.summary, "data_wait_source"),
    }
    kind = get(r.recommendations, "loader_kind")
    share = finite(get(r.recommendations, "loader_cpu_share"))
    if kind is not None:
        evidence.update(loader_kind=kind, loader_cpu_share=share)
    gain = None
    gpu = r.device == "cuda"
    transfer = r.data_transfer or 0.0
    if transfer > 0:
        evidence["data_transfer_ms"] = transfer
    if transfer >= TRANSFER_BOUND_SHARE * r.data_wait:
        # Loader workers do not run the transfer hooks: more of them would not help.
        hooks = (
            "on_before_batch_transfer / transfer_batch_to_device / on_after_batch_transfer"
            if r.lightning
            else "the batch's transfer to the device"
        )
        action = (
            f"the wait is in {hooks} ({transfer:.1f} ms per step), not in the loader: move that "
            "work into the Dataset or the DataLoader's collate_fn, where num_workers runs it in "
            "parallel off the training loop" + ("; pin_memory=True makes the copy itself asynchronous" if gpu else "")
        )
        if workers is not None and (current is None or workers > current):
            # The fetch's own part is data-bound too (recommend() sized the workers from it).
            action += (
                f"; for the fetch's own {r.data_wait - transfer:.1f} ms: DataLoader(num_workers="
                f"{int(workers)}, persistent_workers=True)"
            )
        gain = gain_text(r.step, r.step - transfer) if r.step > transfer else None
    elif workers is not None and (current is None or workers > current):
        # Pinned host memory only speeds copies to a GPU.
        if r.hf_trainer:
            action = (
                f"TrainingArguments(dataloader_num_workers={int(workers)}, "
                f"{'dataloader_pin_memory=True, ' if gpu else ''}dataloader_persistent_workers=True)"
            )
        else:
            action = (
                f"DataLoader(num_workers={int(workers)}, {'pin_memory=True, ' if gpu else ''}persistent_workers=True)"
            )
        if kind == "io":
            action += (
                f": the loader waits rather than computes (its CPU time is {percent(cast(float, share))} of the "
                "time a batch takes to load), so workers beyond the CPU cores help"
            )
        elif needed is not None and needed > workers:
            cores = finite(get(r.recommendations, "loader_cores_needed"))
            action += (
                f"; {int(needed)} workers would hide it fully"
                + (f" and keep {cores:.1f} cores busy" if cores is not None else "")
                + ": give each rank more CPU cores, or cache decoded samples"
            )
        predicted = finite(get(r.recommendations, "num_workers_step_ms"))
        if predicted is not None:
            evidence["predicted_step_ms"] = predicted
            gain = gain_text(r.step, predicted)
    else:
        action = (
            f"the loader is at the CPU limit (num_workers={count_text(current)}, cpus_per_rank="
            f"{count_text(cpus)}): give each rank more CPU cores, cache decoded samples or "
            f"preprocess offline{', or move augmentation to the GPU' if gpu else ''}"
        )
        gain = gain_text(r.step, r.step - r.data_wait) if r.step > r.data_wait else None
    noise = (noise_words(r) if borderline else "") + job_words(r, "data_fraction")
    title = (
        f"Data-bound: waiting for data {r.data_wait:.1f} ms of a {r.step:.1f} ms step "
        f"({percent(r.data_fraction)}, threshold {percent(DATA_BOUND_FRACTION)}{noise})"
        + (f", {transfer:.1f} ms of it in the batch's transfer to the device" if transfer > 0 else "")
    )
    uneven = _uneven_data_wait(r)
    if uneven is not None:
        # A median over ranks is a wait no rank had when they differ this much: say whose.
        slow, slow_ms, others_ms = uneven
        evidence.update(slowest_rank=slow, slowest_rank_data_wait_ms=slow_ms, other_ranks_data_wait_ms=others_ms)
        title += f"; rank {slow} waits {slow_ms:.1f} ms, the other ranks {others_ms:.1f} ms (median)"
    if evidence["data_wait_source"] == "gap":
        # Without prof.loader the wait is the gap before forward: loading or any host work.
        title = (
            f"Data-bound or host-bound: {r.data_wait:.1f} ms of a {r.step:.1f} ms step pass "
            f"between the optimizer step and the next forward ({percent(r.data_fraction)}, "
            f"threshold {percent(DATA_BOUND_FRACTION)}{noise})"
        )
        action = (
            "tell loading from other host work: iterate prof.loader(train_loader) (data wait "
            f"= time blocked in next()); if it is the loader: {action}; if not: move host work "
            "(logging, .item() calls, metrics) out of the step"
        )
    severity = borderline_severity(r) if borderline else severity_band(r.data_fraction, DATA_BOUND_FRACTION)
    return Finding("data_bound", severity, title, evidence, action, gain)


def _uneven_data_wait(r: Readings) -> tuple[int, float, float] | None:
    """(rank, its data wait, the other ranks' median) when one rank waits more than
    :data:`UNEVEN_DATA_WAIT_RATIO` x, and :data:`UNEVEN_DATA_WAIT_MIN_MS` more than, the
    others' median; else None."""
    ranks = [x for x in (get(r.summary, "ranks") or []) if isinstance(x, Mapping)]
    found = [finite(get(x, "data_wait")) for x in ranks]
    if len(found) < 2 or None in found:
        return None
    waits = cast(list[float], found)  # none is None: checked above
    slow = max(range(len(waits)), key=waits.__getitem__)
    others = cast(float, median(w for i, w in enumerate(waits) if i != slow))  # at least one other
    if waits[slow] > UNEVEN_DATA_WAIT_RATIO * others and waits[slow] - others > UNEVEN_DATA_WAIT_MIN_MS:
        return int(finite(get(ranks[slow], "rank")) or 0), waits[slow], others
    return None
