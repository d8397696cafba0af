"""planner/profile_cache.py: the model profile on disk (issue 34 item 2).

A request planned from the cached profile gives the same plan JSON as the one that captured the
model; the key changes with anything the profile depends on (a shape, an option, the loss); a
request needing a context-parallel verdict the entry lacks profiles again and adds it; an
unreadable file is ignored and replaced; a profile timed on this machine is never cached.
"""
import json
import os

import pytest
import torch

from autopar.planner import plan_model, presets, profile_cache
from autopar.planner.report import to_json

_WALL = ("capture_s", "trace_s", "search_s", "solver_s", "profile_cached")  # measured, or where the profile came from


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    return tmp_path


def _plan(pm, gpus=8, **kw):
    res, info = plan_model(pm.model, pm.inputs, pm.target, pm.loss_fn, gpus=gpus, global_batch=16, name=pm.name,
                           layer_repeats=pm.layer_repeats, n_heads=pm.n_heads, seq_len=256, **kw)
    return json.dumps(to_json(res, info), sort_keys=True, default=str), info


def _files(d):
    return sorted(os.listdir(os.path.join(d, "profiles"))) if os.path.isdir(os.path.join(d, "profiles")) else []


def test_cached_profile_gives_the_same_plan(cache_dir, caplog):
    pm = presets.build_preset("llama3-8b", seq_len=256)
    plain, info0 = _plan(pm)
    # off unless asked: neither the profile nor the schedules' in-flight table on disk (this machine's
    # measured device profile, which the default device reads, is its own cache)
    assert not info0["profile_cached"] and set(os.listdir(cache_dir)) <= {"cpu_profile.json"}
    first, info1 = _plan(pm, profile_cache=True)
    assert not info1["profile_cached"] and len(_files(cache_dir)) == 1
    again, info2 = _plan(pm, profile_cache=True)
    assert info2["profile_cached"]

    def strip(obj):  # the phase times differ run to run; the plan does not
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in _WALL}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj
    assert strip(json.loads(again)) == strip(json.loads(first)) == strip(json.loads(plain))
    # another GPU count asks for cp verdicts the entry lacks (cp=16): profiled again, verdicts merged
    _, info3 = _plan(pm, gpus=16, profile_cache=True)
    assert not info3["profile_cached"]
    _, info4 = _plan(pm, gpus=16, profile_cache=True)
    _, info5 = _plan(pm, gpus=8, profile_cache=True)
    assert info4["profile_cached"] and info5["profile_cached"] and len(_files(cache_dir)) == 1
    # an unreadable file: a warning, profiled again, replaced
    path = os.path.join(cache_dir, "profiles", _files(cache_dir)[0])
    with open(path, "wb") as f:
        f.write(b"not a pickle")
    with caplog.at_level("WARNING", logger="autopar"):
        _, info6 = _plan(pm, profile_cache=True)
    assert not info6["profile_cached"] and "unreadable profile cache" in caplog.text
    assert _plan(pm, profile_cache=True)[1]["profile_cached"]


def test_key_follows_what_the_profile_depends_on():
    a = presets.build_preset("llama3-8b", seq_len=256)
    opts = dict(name="m", seq_len=256)
    key = profile_cache.profile_key(a.model, a.inputs, a.target, a.loss_fn, opts)
    assert key == profile_cache.profile_key(presets.build_preset("llama3-8b", seq_len=256).model, a.inputs,
                                            a.target, a.loss_fn, opts)
    b = presets.build_preset("llama3-8b", seq_len=512)  # another sequence length: other inputs and tables
    others = {
        profile_cache.profile_key(b.model, b.inputs, b.target, b.loss_fn, opts),
        profile_cache.profile_key(a.model, a.inputs, a.target, a.loss_fn, {**opts, "seq_len": 128}),
        profile_cache.profile_key(a.model, a.inputs, a.target, torch.nn.functional.cross_entropy, opts),
        profile_cache.profile_key(presets.build_preset("llama3-70b", seq_len=256).model, a.inputs, a.target,
                                  a.loss_fn, opts),
    }
    assert key not in others and len(others) == 4


def test_a_profile_timed_here_is_not_cached(cache_dir):
    from autopar.examples.gpt import make_gpt
    from autopar.planner.profile import profile_model

    model, inputs, target, loss = make_gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, batch_size=2)
    prof = profile_model(model, inputs, target, loss, name="gpt")
    assert prof.unit_timer is not None
    assert profile_cache.store("k" * 64, prof, {}) is None and _files(cache_dir) == []


def test_prune_keeps_the_newest(tmp_path):
    for i, name in enumerate(("a", "b", "c")):
        p = tmp_path / f"{name}.pkl"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_text("kept")
    profile_cache._prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["b.pkl", "c.pkl", "other.txt"]



def _strip(obj):  # the phase times differ run to run; the plan does not
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in _WALL}
    return [_strip(v) for v in obj] if isinstance(obj, list) else obj


def _spin(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


def test_the_plan_does_not_depend_on_the_machine_load(cache_dir):
    """Issue 50 F5: every budget of the search counts work, not seconds, so the same request
    (Llama 3 8B on 8 GPUs of this machine's profile) planned again while a thread spins beside it (the planner then
    gets about half of the interpreter's time) gives the same plan JSON, the measured phase
    times aside."""
    import threading

    pm = presets.build_preset("llama3-8b", seq_len=256)
    quiet, _ = _plan(pm, profile_cache=True)  # (the second search reads the profile back: the search is what budgets)
    stop = threading.Event()
    burners = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(1)]
    for p in burners:
        p.start()
    try:
        loaded, info = _plan(pm, profile_cache=True)
    finally:
        stop.set()
        for p in burners:
            p.join(10)
    assert info["profile_cached"] and _strip(json.loads(loaded)) == _strip(json.loads(quiet))
