"""Device profiles for the planner's cost model: compute, memory and interconnect figures.

A :class:`DeviceProfile` holds what the cost model needs to price one graph node
(:meth:`DeviceProfile.node_time`, a roofline plus a fixed per-node overhead) and one collective
(``intra`` / ``inter`` :class:`Link`, priced by :mod:`autopar.planner.comm`).

The GPU profiles are datasheet figures (dense, no 2:4 sparsity) with the calibration factors
documented next to each; the ``cpu`` profile is *measured* on the current machine by a short
microbenchmark (one intra-op thread, as the runtime runs one thread per process) and cached as
JSON under ``$AUTOPAR_CACHE_DIR`` (default ``~/.cache/autopar/``).

Conventions:

* ``peak_flops["float32"]`` on GPUs is the plain FP32 (non-tensor-core / vector FMA) figure, not
  TF32: PyTorch's default ``torch.backends.cuda.matmul.allow_tf32`` is False, so fp32 matmuls run
  at the plain FP32 rate unless the user opts in.
* ``Link.bandwidth`` is what one rank can push in one direction (bidirectional NVLink / Infinity
  Fabric totals are halved), the ``beta`` of the alpha-beta model. These are peak figures; NCCL
  typically reaches ~75-85% of them in bus bandwidth.
* Memory sizes are the datasheet's decimal gigabytes (slightly under what the device reports,
  which errs on the safe side for memory planning); :func:`current_profile` replaces them with
  the size the running device reports.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from dataclasses import dataclass

log = logging.getLogger("autopar")

_DTYPES = ("float32", "bfloat16", "float16")
# dtype spellings accepted by node_time -> the peak_flops key they use
_DTYPE_ALIASES = {
    "float32": "float32", "float": "float32", "fp32": "float32", "f32": "float32", "tf32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16", "f16": "float16",
}
# dtypes priced at the float32 rate (their ops are elementwise / memory-bound in practice)
_FP32_RATE = {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool",
              "complex64", "float8_e4m3fn", "float8_e5m2"}
_FP64 = {"float64", "double", "fp64"}


@dataclass(frozen=True)
class Link:
    """One class of interconnect in the alpha-beta model."""

    alpha_s: float    # latency per message / per collective step, seconds
    bandwidth: float  # bytes/s per rank per direction (what one rank can push)

    def __post_init__(self):
        if not (_finite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"autopar: Link.alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not (_finite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"autopar: Link.bandwidth must be a finite number > 0, got {self.bandwidth!r}")

    def to_dict(self) -> dict:
        return {"alpha_s": float(self.alpha_s), "bandwidth": float(self.bandwidth)}

    @classmethod
    def from_dict(cls, d: dict) -> "Link":
        return cls(alpha_s=float(d["alpha_s"]), bandwidth=float(d["bandwidth"]))


@dataclass(frozen=True)
class DeviceProfile:
    """Compute, memory and interconnect figures of one device kind."""

    name: str
    peak_flops: dict         # dtype name -> dense FLOP/s; keys "float32", "bfloat16", "float16"
    mem_bandwidth: float     # bytes/s
    memory_bytes: int        # device memory
    flops_efficiency: float  # achieved fraction of peak on large matmuls (calibration)
    mem_efficiency: float    # achieved fraction of memory bandwidth
    op_overhead_s: float     # fixed time per executed graph node (kernel launch / Python dispatch)
    intra: Link              # within a node (NVLink / xGMI)
    inter: Link              # across nodes (InfiniBand / RoCE, per-GPU NIC)
    gpus_per_node: int
    source: str              # where the figures come from
    measured: bool = False
    # bytes/s each way between the device and pinned host memory (activation offload): a PCIe
    # Gen5 x16 link sustains about 25 GB/s per direction beside other traffic; for the cpu
    # profile the "host" is the same memory and a copy costs its streaming bandwidth instead
    host_bandwidth: float = 25e9

    def __post_init__(self):
        missing = [k for k in _DTYPES if k not in self.peak_flops]
        if missing:
            raise ValueError(f"autopar: DeviceProfile {self.name!r}: peak_flops lacks {missing}")
        for k, v in self.peak_flops.items():
            if not (_finite(v) and v > 0):
                raise ValueError(f"autopar: DeviceProfile {self.name!r}: peak_flops[{k!r}] must be > 0, got {v!r}")
        for f in ("mem_bandwidth", "memory_bytes", "flops_efficiency", "mem_efficiency"):
            v = getattr(self, f)
            if not (_finite(v) and v > 0):
                raise ValueError(f"autopar: DeviceProfile {self.name!r}: {f} must be > 0, got {v!r}")
        for f in ("flops_efficiency", "mem_efficiency"):
            if getattr(self, f) > 1:
                raise ValueError(f"autopar: DeviceProfile {self.name!r}: {f} must be <= 1, got {getattr(self, f)!r}")
        if not (_finite(self.op_overhead_s) and self.op_overhead_s >= 0):
            raise ValueError(f"autopar: DeviceProfile {self.name!r}: op_overhead_s must be >= 0, got "
                             f"{self.op_overhead_s!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"autopar: DeviceProfile {self.name!r}: gpus_per_node must be an int >= 1, got "
                             f"{self.gpus_per_node!r}")
        if not isinstance(self.intra, Link) or not isinstance(self.inter, Link):
            raise ValueError(f"autopar: DeviceProfile {self.name!r}: intra and inter must be Link objects")

    def flops_rate(self, dtype: str = "bfloat16") -> float:
        """Achieved FLOP/s for ``dtype``: peak * flops_efficiency.

        ``dtype`` is a name ("bfloat16", "bf16", "float32", ...) or a torch.dtype. float64 runs at
        half the float32 rate unless the profile lists "float64"; integer/bool/float8 dtypes are
        priced at the float32 rate (their nodes are memory-bound in practice)."""
        key = str(dtype).removeprefix("torch.").lower()
        if key in _DTYPE_ALIASES:
            peak = self.peak_flops[_DTYPE_ALIASES[key]]
        elif key in _FP64:
            peak = self.peak_flops.get("float64", self.peak_flops["float32"] / 2)
        elif key in _FP32_RATE:
            peak = self.peak_flops["float32"]
        else:
            known = sorted(set(_DTYPE_ALIASES) | _FP64 | _FP32_RATE)
            raise ValueError(f"autopar: unknown dtype {dtype!r} (known: {known})")
        return peak * self.flops_efficiency

    def node_time(self, flops: float, bytes_moved: float, dtype: str = "bfloat16") -> float:
        """op_overhead_s + max(flops / (peak*eff), bytes_moved / (bw*mem_eff)), in seconds."""
        if not (_finite(flops) and flops >= 0):
            raise ValueError(f"autopar: node_time flops must be >= 0, got {flops!r}")
        if not (_finite(bytes_moved) and bytes_moved >= 0):
            raise ValueError(f"autopar: node_time bytes_moved must be >= 0, got {bytes_moved!r}")
        compute = flops / self.flops_rate(dtype)
        memory = bytes_moved / (self.mem_bandwidth * self.mem_efficiency)
        return self.op_overhead_s + max(compute, memory)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops"] = {k: float(v) for k, v in self.peak_flops.items()}
        d["intra"] = self.intra.to_dict()
        d["inter"] = self.inter.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        """Inverse of :meth:`to_dict`; raises KeyError / TypeError / ValueError on bad input."""
        if not isinstance(d, dict) or not isinstance(d.get("peak_flops"), dict):
            raise ValueError(f"autopar: not a DeviceProfile dict: {d!r}")
        return cls(
            name=str(d["name"]),
            peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
            mem_bandwidth=float(d["mem_bandwidth"]),
            memory_bytes=int(d["memory_bytes"]),
            flops_efficiency=float(d["flops_efficiency"]),
            mem_efficiency=float(d["mem_efficiency"]),
            op_overhead_s=float(d["op_overhead_s"]),
            intra=Link.from_dict(d["intra"]),
            inter=Link.from_dict(d["inter"]),
            gpus_per_node=int(d["gpus_per_node"]),
            source=str(d["source"]),
            measured=bool(d.get("measured", False)),
        )


def _finite(x) -> bool:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return False
    return x == x and x not in (float("inf"), float("-inf"))


def _flops(fp32_t: float, bf16_t: float) -> dict:
    """peak_flops from TFLOPS figures (fp16 runs at the bf16 rate on every GPU listed here)."""
    return {"float32": fp32_t * 1e12, "bfloat16": bf16_t * 1e12, "float16": bf16_t * 1e12}


# ---------------------------------------------------------------------------------------------
# Datasheet GPU profiles (dense figures, no 2:4 sparsity).
#
# Calibration (flops_efficiency / mem_efficiency), "what a large GEMM / a streaming kernel
# reaches":
#   * NVIDIA Hopper / Blackwell: large bf16 GEMMs reach ~650-750 TFLOPS of H100's 989 (cuBLAS),
#     i.e. ~0.7 of peak; 0.7 is used. A100 cuBLAS reaches ~250-270 of 312 TFLOPS -> 0.8.
#     HBM streaming kernels reach ~85-90% of the datasheet bandwidth -> 0.85.
#   * MI300X: hipBLASLt bf16 GEMMs reach roughly 600-700 of the 1307 TFLOPS datasheet figure
#     (public benchmarks, e.g. SemiAnalysis' MI300X vs H100 study, Dec 2024) -> 0.5; HBM
#     streaming ~4.0-4.3 of 5.3 TB/s -> 0.8.
# op_overhead_s on GPUs: the runtime runs fx GraphModules eagerly, one kernel launch per node;
# launches are asynchronous, so the exposed per-node cost is the launch latency (~5 us) when the
# host keeps ahead of the device.
# Inter-node alpha: ~10 us per step (IB verbs + NCCL proxy); NVLink / xGMI alpha ~5 us per step.
# ---------------------------------------------------------------------------------------------

_NVLINK_ALPHA = 5e-6
_IB_ALPHA = 1e-5
_GBps = 1e9


def _nvidia(name, fp32_t, bf16_t, mem_tbps, mem_gb, nvlink_total_gbps, nic_gbit, eff, source):
    return DeviceProfile(
        name=name,
        peak_flops=_flops(fp32_t, bf16_t),
        mem_bandwidth=mem_tbps * 1e12,
        memory_bytes=int(mem_gb * 1e9),
        flops_efficiency=eff,
        mem_efficiency=0.85,
        op_overhead_s=5e-6,
        intra=Link(_NVLINK_ALPHA, nvlink_total_gbps / 2 * _GBps),  # bidirectional total / 2
        inter=Link(_IB_ALPHA, nic_gbit / 8 * _GBps),               # one NIC per GPU, Gb/s -> B/s
        gpus_per_node=8,
        source=source,
    )


_PROFILES: dict[str, DeviceProfile] = {
    # H100 SXM5: FP32 67 TFLOPS; BF16 tensor 1,979 TFLOPS with sparsity -> 989.4 dense (the
    # Hopper whitepaper lists 989.4); 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s bidirectional.
    # DGX H100: 8x ConnectX-7 400 Gb/s (NDR), one per GPU.
    "h100": _nvidia(
        "h100", 67.0, 989.4, 3.35, 80, 900, 400, 0.7,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM datasheet); "
        "https://resources.nvidia.com/en-us-tensor-core (Hopper architecture whitepaper, dense 989.4 TFLOPS); "
        "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html (8x ConnectX-7 400 Gb/s)"),
    # H200 SXM: same GH100 compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
    # DGX H200: 8x ConnectX-7 400 Gb/s.
    "h200": _nvidia(
        "h200", 67.0, 989.4, 4.8, 141, 900, 400, 0.7,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet: FP32 67 TFLOPS, "
        "BF16 1,979 TFLOPS with sparsity, 141 GB, 4.8 TB/s, NVLink 900 GB/s); "
        "https://www.nvidia.com/en-us/data-center/dgx-h200/ (8x ConnectX-7 400 Gb/s)"),
    # A100 80GB SXM4: FP32 19.5 TFLOPS; BF16 tensor 312 TFLOPS dense; 80 GB HBM2e at 2,039 GB/s;
    # NVLink 3 600 GB/s bidirectional. DGX A100: 8x ConnectX-6 200 Gb/s HDR (one per GPU).
    "a100-80gb": _nvidia(
        "a100-80gb", 19.5, 312.0, 2.039, 80, 600, 200, 0.8,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (A100 80GB SXM datasheet); "
        "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html (8x ConnectX-6 200 Gb/s HDR)"),
    # HGX B200 (1000 W): BF16 tensor 4.5 PFLOPS with sparsity -> 2.25 PFLOPS dense; FP32 80
    # TFLOPS (Blackwell architecture technical brief, HGX B200 column); HGX B200 lists 1.44 TB for
    # 8 GPUs -> 180 GB each (the device reports ~179 GiB usable; "192 GB" is the raw HBM3e
    # stack capacity); 8 TB/s; NVLink 5 1.8 TB/s bidirectional. DGX B200: 8x ConnectX-7
    # 400 Gb/s (the ConnectX-8 800 Gb/s option is ignored: conservative).
    "b200": _nvidia(
        "b200", 80.0, 2250.0, 8.0, 180, 1800, 400, 0.7,
        "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 8 GPUs, 1.4 TB HBM3e, 64 TB/s, "
        "BF16 36 PFLOPS sparse per 8 GPUs); "
        "https://resources.nvidia.com/en-us-blackwell-architecture (Blackwell technical brief: HGX B200 "
        "FP32 80 TFLOPS, BF16 2.25 PFLOPS dense); "
        "https://www.nvidia.com/en-us/data-center/dgx-b200/ (8x ConnectX-7 400 Gb/s, NVLink 1.8 TB/s)"),
    # MI300X (OAM, 750 W): BF16 matrix 1,307.4 TFLOPS dense (2,614.9 with sparsity); FP32 vector
    # 163.4 TFLOPS (CDNA 3 dual-issue FP32; the matrix figure is the same); 192 GB HBM3 at
    # 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s bidirectional each to the 7 peers of an
    # 8-GPU fully connected platform (896 GB/s aggregate) -> 7 x 64 = 448 GB/s per direction.
    # That aggregate needs traffic spread over all 7 peers (RCCL's multi-ring / direct
    # algorithms); a single ring uses one link per direction. Scale-out: one 400 Gb/s NIC per
    # GPU (e.g. AMD Pensando Pollara 400 or ConnectX-7 on MI300X platforms).
    "mi300x": DeviceProfile(
        name="mi300x",
        peak_flops=_flops(163.4, 1307.4),
        mem_bandwidth=5.3e12,
        memory_bytes=int(192e9),
        flops_efficiency=0.5,
        mem_efficiency=0.8,
        op_overhead_s=5e-6,
        intra=Link(_NVLINK_ALPHA, 7 * 64 * _GBps),
        inter=Link(_IB_ALPHA, 400 / 8 * _GBps),
        gpus_per_node=8,
        source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (MI300X "
               "specifications: BF16 1307.4 TFLOPS, FP32 vector 163.4 TFLOPS, 192 GB HBM3, 5.3 TB/s, "
               "7 Infinity Fabric links, 128 GB/s peak link bandwidth); "
               "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
               "amd-instinct-mi300x-data-sheet.pdf; "
               "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
               "amd-instinct-mi300x-platform-data-sheet.pdf (896 GB/s aggregate peer bandwidth)",
    ),
}

# substrings of torch.cuda.get_device_name() -> profile (first match wins; order matters)
_GPU_NAME_PATTERNS = (
    ("H200", "h200"),
    ("H100", "h100"),
    ("A100", "a100-80gb"),
    ("B200", "b200"),
    ("MI300X", "mi300x"),
)


def names() -> tuple[str, ...]:
    """The profile names :func:`get_profile` accepts."""
    return tuple(_PROFILES) + ("cpu",)


def get_profile(name: str, refresh: bool = False) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); "cpu" measures/caches this machine's."""
    key = str(name).lower()
    if key == "cpu":
        return cpu_profile(refresh=refresh)
    if key not in _PROFILES:
        raise ValueError(f"autopar: unknown device profile {name!r}; known: {', '.join(names())}")
    return _PROFILES[key]


# ---------------------------------------------------------------------------------------------
# CPU profile: measured here, cached per machine.
#
# Links for cpu (gloo over loopback between processes) are not measured: alpha 50 us per step
# and 2 GB/s are documented approximations of gloo's TCP-over-loopback collectives. Every
# process group counts as intra (gpus_per_node = 2**30).
# ---------------------------------------------------------------------------------------------

_CPU_LINK = Link(alpha_s=5e-5, bandwidth=2e9)
_CACHE_FILE = "cpu_profile.json"
_CACHE_VERSION = 1


def cache_dir() -> str:
    """``$AUTOPAR_CACHE_DIR``, default ``~/.cache/autopar``."""
    return os.environ.get("AUTOPAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autopar")


def _fingerprint() -> dict:
    import torch

    return {"node": platform.node(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__}


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def measure_cpu() -> dict:
    """Measure this machine with one intra-op thread (about 1 s): returns
    ``{"matmul_flops", "mem_bandwidth", "op_overhead_s"}``.

    * matmul_flops: best fp32 ``mm`` rate over 256..512 square sizes (2*n^3 FLOPs per mm);
    * mem_bandwidth: best of a 64 MiB tensor copy (read + write) and add (2 reads + 1 write),
      bytes read + written per second (larger than the usual last-level cache);
    * op_overhead_s: median per-node time of a torch.fx GraphModule of 200 tiny aten
      elementwise ops on 8-element tensors under no_grad, as the runtime executes programs.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return {"matmul_flops": _measure_matmul(torch), "mem_bandwidth": _measure_bandwidth(torch),
                    "op_overhead_s": _measure_overhead(torch)}
    finally:
        torch.set_num_threads(threads)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure_matmul(torch) -> float:
    rate = 0.0
    for n in (256, 384, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up
        t = _best(lambda: torch.mm(a, b, out=out), 5)
        rate = max(rate, 2.0 * n ** 3 / t)
    return rate


def _measure_bandwidth(torch) -> float:
    n = 16 << 20  # 16 Mi float32 = 64 MiB per tensor
    a, b = torch.ones(n), torch.ones(n)
    out = torch.empty(n)
    out.copy_(a)  # touch every page before timing
    t_copy = _best(lambda: out.copy_(a), 5)
    t_add = _best(lambda: torch.add(a, b, out=out), 5)
    nbytes = 4 * n
    return max(2 * nbytes / t_copy, 3 * nbytes / t_add)


def _overhead_module(torch, num_nodes: int = 200):
    import torch.fx as fx

    aten = torch.ops.aten
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    ops = (aten.add.Tensor, aten.mul.Tensor, aten.relu.default, aten.sub.Tensor, aten.neg.default)
    cur = x
    for i in range(num_nodes):
        op = ops[i % len(ops)]
        args = (cur,) if op in (aten.relu.default, aten.neg.default) else (cur, y)
        cur = g.call_function(op, args)
    g.output((cur,))
    return fx.GraphModule(torch.nn.Module(), g)


def _measure_overhead(torch) -> float:
    num_nodes = 200
    gm = _overhead_module(torch, num_nodes)
    x, y = torch.randn(8), torch.randn(8)
    for _ in range(3):
        gm(x, y)
    times = []
    for _ in range(41):
        t0 = time.perf_counter()
        gm(x, y)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / num_nodes


def _cpu_profile_from(m: dict) -> DeviceProfile:
    import torch

    return DeviceProfile(
        name="cpu",
        # one thread, fp32 measured; bfloat16/float16 use the same figure (CPU bf16 matmuls are
        # at best comparable to fp32 without AMX, and often slower)
        peak_flops={"float32": m["matmul_flops"], "bfloat16": m["matmul_flops"], "float16": m["matmul_flops"]},
        mem_bandwidth=m["mem_bandwidth"],
        memory_bytes=_memory_bytes(),
        flops_efficiency=1.0,  # the measurement is the achieved rate
        mem_efficiency=1.0,
        op_overhead_s=m["op_overhead_s"],
        intra=_CPU_LINK,
        inter=_CPU_LINK,
        gpus_per_node=1 << 30,
        source=f"measured on {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread) "
               f"by autopar.planner.devices.measure_cpu; links: gloo loopback approximations",
        measured=True,
    )


def _read_cache(path: str, fingerprint: dict) -> DeviceProfile | None:
    try:
        with open(path) as f:
            data = json.load(f)
        stamp = (data.get("version"), data.get("fingerprint")) if isinstance(data, dict) else None
        if stamp != (_CACHE_VERSION, fingerprint):
            return None
        return DeviceProfile.from_dict(data["profile"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("autopar: ignoring unreadable cpu profile cache %s (%s: %s)", path, type(e).__name__, e)
        return None


def _write_cache(path: str, fingerprint: dict, profile: DeviceProfile) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"version": _CACHE_VERSION, "fingerprint": fingerprint, "profile": profile.to_dict()}, f,
                      indent=1)
        os.replace(tmp, path)  # atomic: concurrent processes never see a half-written file
    except OSError as e:
        log.warning("autopar: could not write the cpu profile cache %s: %s", path, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def cpu_profile(refresh: bool = False) -> DeviceProfile:
    """This machine's measured CPU profile, from the cache when its fingerprint matches.

    ``refresh=True`` re-measures; a missing, corrupt or other-machine cache file is re-measured
    and rewritten."""
    path = os.path.join(cache_dir(), _CACHE_FILE)
    fp = _fingerprint()
    if not refresh:
        cached = _read_cache(path, fp)
        if cached is not None:
            return cached
    log.info("autopar: measuring the cpu device profile (one thread, ~1 s); cached at %s", path)
    profile = _cpu_profile_from(measure_cpu())
    _write_cache(path, fp, profile)
    return profile


# ---------------------------------------------------------------------------------------------
# The running device
# ---------------------------------------------------------------------------------------------

def _fallback_gpu(name: str, total_memory: int, count: int) -> DeviceProfile:
    """Conservative figures for a GPU without a profile: ~A100-class bf16, PCIe-class links."""
    return DeviceProfile(
        name=f"cuda:{name}",
        peak_flops=_flops(20.0, 150.0),
        mem_bandwidth=1.5e12,
        memory_bytes=int(total_memory),
        flops_efficiency=0.6,
        mem_efficiency=0.75,
        op_overhead_s=1e-5,
        intra=Link(1e-5, 25e9),     # PCIe Gen4 x16-class peer traffic
        inter=Link(2e-5, 12.5e9),   # 100 Gb/s NIC
        gpus_per_node=max(1, int(count)),
        source=f"conservative fallback for an unprofiled GPU ({name}); memory from torch.cuda.get_device_properties",
    )


def profile_for_gpu_name(gpu_name: str) -> DeviceProfile | None:
    """The datasheet profile matching a ``torch.cuda.get_device_name()`` string, else None."""
    upper = gpu_name.upper()
    for pattern, key in _GPU_NAME_PATTERNS:
        if pattern in upper:
            return _PROFILES[key]
    return None


def current_profile() -> DeviceProfile:
    """The profile of the device this process computes on: the current CUDA/ROCm GPU when one
    is available (matched by name; its reported memory replaces the datasheet figure), else the
    measured cpu profile. An unknown GPU gets a conservative fallback and a logged warning."""
    import torch

    if not torch.cuda.is_available():
        return cpu_profile()
    dev = torch.cuda.current_device()
    gpu_name = torch.cuda.get_device_name(dev)
    props = torch.cuda.get_device_properties(dev)
    profile = profile_for_gpu_name(gpu_name)
    if profile is None:
        log.warning("autopar: no device profile for GPU %r; using conservative fallback figures "
                    "(known profiles: %s)", gpu_name, ", ".join(names()))
        return _fallback_gpu(gpu_name, props.total_memory, torch.cuda.device_count())
    if "PCIE" in gpu_name.upper() or "NVL" in gpu_name.upper():
        log.warning("autopar: GPU %r is priced with the SXM profile %r (its clocks and links may be lower)",
                    gpu_name, profile.name)
    return dataclasses.replace(profile, memory_bytes=int(props.total_memory))
