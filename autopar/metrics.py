"""What ``pm.metrics`` holds after each step, and the line ``log_every`` prints.

* ``loss``: the step's loss; ``grad_norm``: the global gradient norm before clipping (with
  ``max_grad_norm``, or ``track_grad_norm=True``);
* ``step_time_s``: wall time of ``pm.step`` (the slowest rank decides: it ends with the
  loss broadcast); ``tokens_per_s``: tokens of the global batch over it;
* ``mfu``: model FLOPs utilization, the F, I and W programs' FLOPs of every stage (counted
  from the captured graph, as the planner counts them) for the global batch, over
  ``step_time_s x world x the device profile's peak`` (the dtype the programs compute in);
* ``peak_memory_bytes``: this process's peak: the CUDA allocator's ``max_memory_allocated``
  on GPU, the peak resident set size on CPU;
* ``predicted_step_s`` / ``predicted_peak_bytes``: the planner's, when it chose the plan;
* ``moe_max_receive_rows`` / ``moe_mean_receive_rows`` / ``moe_receive_ratio`` /
  ``moe_max_receive_layer`` (models with dropless MoE blocks under EP or alone): the most routed
  rows one rank of an EP group received in one dispatch of this step (over the MoE layers this
  process runs; every rank of a group sees the group's counts), the mean receive per rank and
  dispatch, their ratio (1.0: perfectly balanced) and the layer of the largest;
  ``moe_priced_ratio``: the plan's ``moe_imbalance`` (what its memory was priced at),
  ``moe_over_priced``: this step's dispatches whose largest receive went over it (they ran on,
  with a rate-limited warning), ``moe_steps_over_priced``: the steps so far with at least one
  (passes/moe_dispatch.py). Only this model's experts modules count.
"""
from __future__ import annotations

import logging
import resource
import sys

import torch

from autopar.collectives import moe_exchange

log = logging.getLogger("autopar")


def step_flops(built) -> float:
    """FLOPs of one step over the global batch (collective in distributed mode: each process
    counts its stages' programs per microbatch; every replica and cp rank runs its own share)."""
    mine = [p for p in built.programs if hasattr(p, "f")]
    per_mb = float(sum(p.f.flops + p.i.flops + p.w.flops for p in mine))
    m = built.num_microbatches
    if built.mesh is None:
        return per_mb * m * built.plan.dp
    total = torch.tensor(per_mb * m, dtype=torch.float64)
    from autopar.collectives import comms

    comms.all_reduce_sum(total)
    return float(total)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_flops(built) -> float:
    """The device profile's dense FLOP/s for the dtype the programs compute in."""
    from autopar.planner.devices import current_profile

    device = current_profile()
    dtype = "float32"
    for p in built.params.values():
        if p.is_floating_point() and not p.is_meta:
            dtype = str(p.dtype).removeprefix("torch.")
            break
    return device.flops_rate(dtype if dtype in ("bfloat16", "float16") else "float32") / device.flops_efficiency


class Recorder:
    """Builds ``pm.metrics`` after each step; the step's FLOPs and the device's peak once."""

    def __init__(self):
        self.flops = self.peak = None
        self.steps_over_priced = 0

    def setup(self, built) -> None:
        """The step's FLOPs (collective: every rank calls this at build) and the device's peak."""
        if self.flops is None:
            self.flops, self.peak = step_flops(built), peak_flops(built)

    def record(self, built, inputs, loss, norm, elapsed: float, step: int, log_every: int) -> dict:
        from autopar.batches import tokens

        self.setup(built)
        if step == 1 and built.plan.compile:  # the first step compiled the programs it ran
            from autopar.runtime.compiled import compile_report

            log.info("autopar: %s", compile_report(built.programs))
        samples = built.microbatch_size * built.num_microbatches * built.plan.dp
        out = {"step": step, "loss": float(loss), "grad_norm": None if norm is None else float(norm),
               "step_time_s": elapsed, "tokens_per_s": tokens(inputs, samples) / elapsed, "flops": self.flops,
               "mfu": self.flops / (elapsed * built.plan.world_size * self.peak),
               "peak_memory_bytes": peak_memory_bytes(built.device),
               **{k: v for k, v in (built.prediction or {}).items() if k != "summary"}}
        if built.executor.work.offload is not None:
            out["offloaded_bytes"] = built.executor.work.offload.offloaded_bytes
        routed = moe_exchange.receive_stats(built.moe_entries)
        if routed["dispatches"]:
            self.steps_over_priced += bool(routed["over_priced"])
            out.update(moe_max_receive_rows=routed["max_rows"], moe_mean_receive_rows=routed["mean_rows"],
                       moe_receive_ratio=routed["ratio"], moe_max_receive_layer=routed["layer"],
                       moe_priced_ratio=built.plan.moe_imbalance, moe_over_priced=routed["over_priced"],
                       moe_steps_over_priced=self.steps_over_priced)
        if log_every and step % log_every == 0 and (built.mesh is None or built.mesh.rank == 0):
            log.info("%s", line(out))
        return out


def install_rank_logging(rank: int) -> None:
    """Every autopar log record carries its rank, and the autopar logger logs INFO; without a
    handler of the user's (on it or the root logger), one that prints ``[autopar rank N]``
    lines to stderr."""
    logger = logging.getLogger("autopar")

    class _Rank(logging.Filter):
        def filter(self, record):
            record.rank = rank
            return True

    if not any(isinstance(f, _Rank.__base__) and type(f).__name__ == "_Rank" for f in logger.filters):
        logger.addFilter(_Rank())
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[autopar rank %(rank)s] %(message)s"))
        logger.addHandler(handler)


def line(metrics: dict) -> str:
    """One log line: the step's numbers, the planner's predictions beside them."""
    def pred(key: str, fmt) -> str:
        return f" (planner {fmt(metrics[key])})" if metrics.get(key) is not None else ""

    parts = [f"step {metrics['step']}", f"loss {metrics['loss']:.6g}"]
    if metrics.get("grad_norm") is not None:
        parts.append(f"grad norm {metrics['grad_norm']:.4g}")
    parts.append(f"{metrics['step_time_s'] * 1e3:.1f} ms" + pred("predicted_step_s", lambda v: f"{v * 1e3:.1f} ms"))
    parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    if metrics.get("mfu") is not None:
        parts.append(f"MFU {metrics['mfu'] * 100:.2f}%")
    if metrics.get("moe_receive_ratio") is not None:
        parts.append(f"MoE receive max {metrics['moe_max_receive_rows']} rows "
                     f"({metrics['moe_receive_ratio']:.2f}x mean, {metrics['moe_max_receive_layer']})")
    parts.append(f"peak {metrics['peak_memory_bytes'] / 2**20:.1f} MiB"
                 + pred("predicted_peak_bytes", lambda v: f"{v / 2**20:.1f} MiB"))
    return ", ".join(parts)
