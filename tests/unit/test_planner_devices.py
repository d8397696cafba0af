"""Device profiles (autopar.planner.devices) and the alpha-beta collective model (planner.comm)."""
import json
import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from autopar.planner import comm, devices
from autopar.planner.devices import DeviceProfile, Link

GPUS = [n for n in devices.names() if n != "cpu"]
COLLECTIVES = [comm.all_reduce_time, comm.reduce_scatter_time, comm.all_gather_time, comm.all_to_all_time]

links = st.builds(Link, alpha_s=st.floats(0, 1e-3), bandwidth=st.floats(1e6, 1e13))
sizes = st.floats(0, 1e12)
ranks = st.integers(1, 1024)


# --------------------------------------------------------------------------- comm


@given(links, sizes, sizes, ranks)
def test_collectives_monotone_in_bytes(link, b1, b2, n):
    lo, hi = sorted((b1, b2))
    for f in COLLECTIVES:
        assert f(lo, n, link) <= f(hi, n, link)
    assert comm.p2p_time(lo, link) <= comm.p2p_time(hi, link)


@given(links, sizes, ranks, ranks)
def test_collectives_monotone_in_ranks(link, b, n1, n2):
    lo, hi = sorted((n1, n2))
    for f in COLLECTIVES:
        assert f(b, lo, link) <= f(b, hi, link) * (1 + 1e-12)


@given(links, sizes)
def test_single_rank_is_free_but_p2p_is_not(link, b):
    for f in COLLECTIVES:
        assert f(b, 1, link) == 0.0
    assert comm.p2p_time(b, link) == pytest.approx(link.alpha_s + b / link.bandwidth)
    assert comm.p2p_time(b, link) >= link.alpha_s


@given(links, sizes, ranks)
def test_all_reduce_is_reduce_scatter_plus_all_gather(link, b, n):
    ar = comm.all_reduce_time(b, n, link)
    assert math.isclose(ar, comm.reduce_scatter_time(b, n, link) + comm.all_gather_time(b, n, link),
                        rel_tol=1e-12, abs_tol=1e-300)


def test_collective_formulas():
    link = Link(alpha_s=1e-5, bandwidth=1e9)
    assert comm.all_reduce_time(8e9, 8, link) == pytest.approx(14e-5 + 2 * 7 / 8 * 8)
    assert comm.reduce_scatter_time(8e9, 8, link) == pytest.approx(7e-5 + 7 / 8 * 8)
    assert comm.all_gather_time(8e9, 4, link) == pytest.approx(3e-5 + 3 / 4 * 8)
    assert comm.all_to_all_time(8e9, 2, link) == pytest.approx(1e-5 + 4)
    assert comm.p2p_time(1e9, link) == pytest.approx(1 + 1e-5)
    assert comm.all_reduce_time(0, 4, link) == pytest.approx(6e-5)  # latency only


@pytest.mark.parametrize("f", COLLECTIVES)
def test_collective_input_validation(f):
    link = Link(1e-5, 1e9)
    with pytest.raises(ValueError, match="-5"):
        f(-5, 4, link)
    with pytest.raises(ValueError, match="nan"):
        f(float("nan"), 4, link)
    for n in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=str(n)):
            f(100, n, link)
    with pytest.raises(ValueError, match="-1"):
        comm.p2p_time(-1, link)


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_group_link_intra_iff_group_fits_in_a_node(gpn, size, stride):
    p = dataclass_replace(devices.get_profile("h100"), gpus_per_node=gpn)
    link = comm.group_link(p, size, stride)
    assert link is (p.intra if size == 1 or stride * size <= gpn else p.inter)


def test_group_link_cases():
    h100 = devices.get_profile("h100")
    assert comm.group_link(h100, 8, 1) is h100.intra    # one node's 8 GPUs
    assert comm.group_link(h100, 2, 4) is h100.intra    # ranks 0 and 4
    assert comm.group_link(h100, 1, 64) is h100.intra   # a group of one never leaves its GPU
    assert comm.group_link(h100, 2, 8) is h100.inter    # ranks 0 and 8: two nodes
    assert comm.group_link(h100, 16, 1) is h100.inter
    cpu_like = dataclass_replace(h100, gpus_per_node=1 << 30)
    assert comm.group_link(cpu_like, 1024, 1024) is cpu_like.intra
    with pytest.raises(ValueError, match="group_size"):
        comm.group_link(h100, 0, 1)
    with pytest.raises(ValueError, match="stride"):
        comm.group_link(h100, 2, 0)


def dataclass_replace(p, **kw):
    import dataclasses

    return dataclasses.replace(p, **kw)


# --------------------------------------------------------------------------- GPU profiles


@pytest.mark.parametrize("name", GPUS)
def test_gpu_profiles_are_positive_and_round_trip(name):
    p = devices.get_profile(name)
    assert p.name == name and not p.measured and p.source.startswith("https://")
    assert set(p.peak_flops) >= {"float32", "bfloat16", "float16"}
    assert all(v > 0 for v in p.peak_flops.values())
    assert p.peak_flops["bfloat16"] > p.peak_flops["float32"]
    assert p.mem_bandwidth > 1e12 and p.memory_bytes >= 80e9
    assert 0 < p.flops_efficiency <= 1 and 0 < p.mem_efficiency <= 1
    assert 0 <= p.op_overhead_s < 1e-4
    assert p.gpus_per_node == 8
    assert p.intra.bandwidth > p.inter.bandwidth > 0 and 0 < p.intra.alpha_s <= p.inter.alpha_s
    assert DeviceProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_gpu_profile_relations():
    h100, h200, a100, b200 = (devices.get_profile(n) for n in ("h100", "h200", "a100-80gb", "b200"))
    assert h200.memory_bytes > h100.memory_bytes and h200.mem_bandwidth > h100.mem_bandwidth
    assert h200.peak_flops == h100.peak_flops
    assert a100.peak_flops["bfloat16"] < h100.peak_flops["bfloat16"] < b200.peak_flops["bfloat16"]
    assert h100.intra.bandwidth == 450e9 and b200.intra.bandwidth == 900e9 and a100.intra.bandwidth == 300e9
    assert a100.inter.bandwidth == 25e9 and h100.inter.bandwidth == 50e9


def test_names_and_unknown_profile():
    assert set(devices.names()) == {"h100", "h200", "a100-80gb", "mi300x", "b200", "cpu"}
    assert devices.get_profile("H100") is devices.get_profile("h100")
    with pytest.raises(ValueError, match="h100.*cpu"):
        devices.get_profile("tpu-v5")


def test_profile_validation():
    good = devices.get_profile("h100").to_dict()
    for field, bad in [("mem_bandwidth", -1.0), ("flops_efficiency", 1.5), ("op_overhead_s", -1e-6),
                       ("gpus_per_node", 0), ("peak_flops", {"float32": 1e12})]:
        with pytest.raises(ValueError, match=field if field != "peak_flops" else "lacks"):
            DeviceProfile.from_dict({**good, field: bad})
    with pytest.raises(ValueError, match="bandwidth"):
        Link(1e-6, 0)


@given(st.sampled_from(GPUS), st.floats(0, 1e18), st.floats(0, 1e14),
       st.sampled_from(["float32", "bfloat16", "float16"]))
def test_node_time_is_roofline_plus_overhead(name, flops, nbytes, dtype):
    p = devices.get_profile(name)
    expect = p.op_overhead_s + max(flops / (p.peak_flops[dtype] * p.flops_efficiency),
                                   nbytes / (p.mem_bandwidth * p.mem_efficiency))
    assert p.node_time(flops, nbytes, dtype) == pytest.approx(expect, rel=1e-12)


def test_node_time_dtypes_and_errors():
    p = devices.get_profile("h100")
    assert p.node_time(1e15, 0) == p.node_time(1e15, 0, "bf16") == p.node_time(1e15, 0, torch.bfloat16)
    assert p.node_time(1e15, 0, torch.float32) > p.node_time(1e15, 0, torch.bfloat16)
    expected = p.op_overhead_s + 2e15 / (p.peak_flops["float32"] * p.flops_efficiency)
    assert p.node_time(1e15, 0, "float64") == pytest.approx(expected)
    assert p.node_time(0, 0) == p.op_overhead_s
    with pytest.raises(ValueError, match="bfloat61"):
        p.node_time(1, 1, "bfloat61")
    with pytest.raises(ValueError, match="-1"):
        p.node_time(-1, 0)


# --------------------------------------------------------------------------- cpu profile


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return devices.measure_cpu()


def test_measured_cpu_figures_are_sane(measured):
    assert 1e8 <= measured["matmul_flops"] <= 1e13
    assert 1e8 <= measured["mem_bandwidth"] <= 1e12
    assert 1e-7 <= measured["op_overhead_s"] <= 1e-3
    assert torch.get_num_threads() == 1


def test_measure_cpu_uses_one_thread_and_restores(monkeypatch):
    seen = []
    monkeypatch.setattr(devices, "_measure_matmul", lambda t: seen.append(t.get_num_threads()) or 1e10)
    monkeypatch.setattr(devices, "_measure_bandwidth", lambda t: seen.append(t.get_num_threads()) or 1e10)
    monkeypatch.setattr(devices, "_measure_overhead", lambda t: seen.append(t.get_num_threads()) or 1e-6)
    torch.set_num_threads(2)
    try:
        devices.measure_cpu()
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


@pytest.fixture
def counted(measured, monkeypatch, tmp_path):
    """A tmp cache dir and a measure_cpu stand-in that counts its calls."""
    calls = []

    def fake():
        calls.append(1)
        return dict(measured)

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(devices, "measure_cpu", fake)
    return calls, tmp_path / "cache" / "cpu_profile.json"


def test_cpu_profile_is_measured_once_then_cached(counted, measured, monkeypatch, caplog):
    calls, path = counted
    with caplog.at_level(logging.INFO, logger="autopar"):
        p = devices.cpu_profile()
    assert calls == [1] and path.exists()
    assert sum("measuring" in r.getMessage() for r in caplog.records) == 1
    assert p.measured and p.name == "cpu"
    assert p.peak_flops["float32"] == p.peak_flops["bfloat16"] == measured["matmul_flops"]
    assert p.mem_bandwidth == measured["mem_bandwidth"] and p.op_overhead_s == measured["op_overhead_s"]
    assert p.flops_efficiency == p.mem_efficiency == 1.0
    assert p.gpus_per_node == 1 << 30 and p.intra == p.inter == Link(5e-5, 2e9)
    assert 1 << 28 < p.memory_bytes < 1 << 50

    def boom():
        raise AssertionError("re-measured although the cache is valid")

    monkeypatch.setattr(devices, "measure_cpu", boom)
    assert devices.cpu_profile() == p
    assert devices.get_profile("cpu") == p


def test_cpu_profile_refresh_remeasures(counted):
    calls, _ = counted
    devices.cpu_profile()
    devices.cpu_profile(refresh=True)
    devices.get_profile("cpu", refresh=True)
    assert len(calls) == 3


@pytest.mark.parametrize("content", [
    "{not json", "", "[1, 2]", '{"version": 1}',
    "CORRUPT_PROFILE",  # valid structure, negative bandwidth
])
def test_corrupt_cache_is_remeasured(counted, content):
    calls, path = counted
    good = devices.cpu_profile()
    if content == "CORRUPT_PROFILE":
        data = json.loads(path.read_text())
        data["profile"]["mem_bandwidth"] = -1
        content = json.dumps(data)
    path.write_text(content)
    assert devices.cpu_profile() == good
    assert len(calls) == 2
    assert devices.DeviceProfile.from_dict(json.loads(path.read_text())["profile"]) == good  # rewritten
    devices.cpu_profile()
    assert len(calls) == 2


def test_cache_of_another_machine_is_remeasured(counted, monkeypatch):
    calls, _ = counted
    devices.cpu_profile()
    monkeypatch.setattr(devices.platform, "node", lambda: "some-other-host")
    devices.cpu_profile()
    assert len(calls) == 2


def test_unwritable_cache_dir_still_returns_a_profile(counted, monkeypatch, tmp_path):
    calls, _ = counted
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(blocker / "sub"))  # parent is a file
    assert devices.cpu_profile().measured and len(calls) == 1


def test_current_profile_without_cuda_is_cpu(counted, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.current_profile() == devices.cpu_profile()


def _fake_cuda(monkeypatch, name, total_memory):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=total_memory))


@pytest.mark.parametrize("gpu_name,profile", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x"),
])
def test_current_profile_matches_gpu_name(monkeypatch, gpu_name, profile):
    _fake_cuda(monkeypatch, gpu_name, 85_000_000_000)
    p = devices.current_profile()
    assert p.name == profile and p.memory_bytes == 85_000_000_000
    assert p.peak_flops == devices.get_profile(profile).peak_flops


def test_current_profile_unknown_gpu_falls_back_with_warning(monkeypatch, caplog):
    _fake_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", 24_000_000_000)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        p = devices.current_profile()
    assert "RTX 4090" in p.name and p.memory_bytes == 24_000_000_000 and p.gpus_per_node == 4
    assert any("no device profile" in r.getMessage() for r in caplog.records)
    assert p.peak_flops["bfloat16"] < devices.get_profile("h100").peak_flops["bfloat16"]


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    assert devices.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "autopar")
