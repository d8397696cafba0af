"""Issue 36 U2: ``autopar.Muon`` over gloo under ZeRO-1/2/3, pp x dp (zbv) and dp x ep, against
eager ``torch.optim.Muon`` on the routed matrices plus ``torch.optim.AdamW`` on the rest
(tests/reference.EagerMuonAdamW, float32 Newton-Schulz in both): loss 1e-5, parameters 1e-4
after three steps; the replicas hold bitwise-identical parameters.

Under ZeRO every Muon matrix lies wholly in one replica's shard (passes/zero_layout.
aligned_offsets); ``test_aligned_layout_keeps_matrices_whole`` shows the packed layout would
cut GPT's matrices at the shard boundary, and the aligned one cuts none.

One process group per world size runs every sub-case of that size.
"""
import math
import os

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

STEPS = 3
MATRIX = {
    2: [("zero1", "gpt3", dict(dp=2, num_microbatches=2, zero=1)),
        ("zero3", "gpt", dict(dp=2, num_microbatches=2, zero=3)),
        ("dp2 x ep2 mixtral", "mixtral", dict(dp=2, ep=2, num_microbatches=2, zero=1)),
        # tensor parallelism: each sharded matrix gathered over tp for Newton-Schulz (GPT: packed q/k/v)
        ("tp2", "gpt", dict(tp=2, num_microbatches=2))],
    4: [("pp2 x dp2 zbv zero1", "gpt", dict(pp=2, dp=2, schedule="zbv", num_microbatches=4, zero=1)),
        # expert shards ZeRO-3-sharded over their 2-rank expert-data-parallel group, whole matrices each
        ("dp4 x ep2 zero3 moe", "moe_ep", dict(dp=4, ep=2, num_microbatches=2, zero=3)),
        ("dp2 x tp2 zero2", "llama", dict(dp=2, tp=2, num_microbatches=2, zero=2))],
}
# AUTOPAR_MUON_FULL=1 (.ci/run sets it after the README command): the 4-process matrix (pp x dp
# zbv, dp x ep ZeRO-3, dp x tp ZeRO-2) and ZeRO-2 at dp=2 alone
if os.environ.get("AUTOPAR_MUON_FULL") == "1":
    MATRIX[2].append(("zero2", "gpt", dict(dp=2, num_microbatches=2, zero=2)))
else:
    del MATRIX[4]


def _spec():
    import autopar

    return autopar.Muon(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)


def _case(name: str):
    """``gpt3``: GPT with 3 blocks (with 4, the packed ZeRO-1 vector of its matrices would split
    between blocks 1 and 2 and cut none)."""
    from autopar.examples import gpt
    from tests.hf_models import make_hf
    from tests.models import ALL_CASES, BATCH, ModelCase

    if name == "gpt3":
        return ModelCase(name, *gpt.make_gpt(n_layer=3, d_model=32, n_head=4, vocab_size=256, seq_len=32,
                                             batch_size=BATCH, seed=4))
    return make_hf(name, seed=4) if name == "mixtral" else ALL_CASES[name](seed=4)


def _run(rank, world, subcases):
    import traceback

    import autopar

    out = []
    for _label, name, plan in subcases:
        try:
            case = _case(name)
            pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=_spec(),
                                     plan=autopar.Plan(**plan), example_target=case.target, timeout=60)
            losses = [pm.step(case.inputs, case.target) for _ in range(STEPS)]
            out.append({"losses": losses, "state": pm.state_dict()})
        except Exception:  # noqa: BLE001 - report per sub-case
            out.append({"traceback": traceback.format_exc()})
    return out


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_muon_distributed_matches_eager(world):
    from autopar.passes import capture
    from autopar.passes.optimizer_routing import route_parameters
    from tests.reference import EagerMuonAdamW, assert_close_state, eager_reference

    subcases = MATRIX[world]
    per_rank = run_shared(_run, world, subcases, deadline_s=600, reuse=False)
    failures = []
    for i, (label, name, plan) in enumerate(subcases):
        try:
            case = _case(name)
            routes = route_parameters(capture(case.model, case.inputs, case.target, case.loss_fn))
            ref_losses, ref_state = eager_reference(
                case.model, case.inputs, case.target, case.loss_fn, EagerMuonAdamW.factory(_spec()),
                dp=plan.get("dp", 1), num_microbatches=plan["num_microbatches"], steps=STEPS,
                param_groups=lambda f, p: {"muon": routes[f].muon})
            for r in range(world):
                res = per_rank[r][i]
                assert "traceback" not in res, f"rank {r}:\n{res.get('traceback')}"
                for got, want in zip(res["losses"], ref_losses):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
                assert_close_state(res["state"], ref_state, rtol=1e-4, atol=1e-5)
                for k, v in res["state"].items():  # replicas: bit for bit
                    assert torch.equal(v, per_rank[0][i]["state"][k]), (r, k)
        except AssertionError as e:
            failures.append(f"{label}: {e}")
    assert not failures, "\n".join(failures)


def _save_then_resume(rank, world, path):
    """U4: 3 steps under dp=2 ZeRO-2, save; a fresh model under pp=2 loads it, 2 more steps."""
    import autopar

    case = _case("gpt")
    pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=_spec(),
                             plan=autopar.Plan(**SAVE_PLAN), example_target=case.target, timeout=60)
    losses = [pm.step(case.inputs, case.target) for _ in range(3)]
    pm.save(path)
    fresh = _case("gpt")
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.mul_(0.5)  # the load must replace every value
    pm = autopar.parallelize(fresh.model, case.inputs, loss_fn=case.loss_fn, optimizer=_spec(),
                             plan=autopar.Plan(**RESUME_PLAN), example_target=case.target, timeout=60)
    pm.load(path)
    losses += [pm.step(case.inputs, case.target) for _ in range(2)]
    return {"losses": losses, "state": pm.state_dict()}


SAVE_PLAN = dict(dp=2, num_microbatches=2, zero=2)
RESUME_PLAN = dict(pp=2, schedule="1f1b", num_microbatches=4)  # the same 4 microbatches


def test_checkpoint_zero2_to_pp2_matches_uninterrupted_eager(tmp_path):
    from autopar.passes import capture
    from autopar.passes.optimizer_routing import route_parameters
    from tests.reference import EagerMuonAdamW, assert_close_state, eager_reference

    per_rank = run_shared(_save_then_resume, 2, str(tmp_path / "ckpt"), deadline_s=300, reuse=False)
    case = _case("gpt")
    routes = route_parameters(capture(case.model, case.inputs, case.target, case.loss_fn))
    ref_losses, ref_state = eager_reference(
        case.model, case.inputs, case.target, case.loss_fn, EagerMuonAdamW.factory(_spec()), dp=2,
        num_microbatches=2, steps=5, param_groups=lambda f, p: {"muon": routes[f].muon})
    for res in per_rank:
        for got, want in zip(res["losses"], ref_losses, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        assert_close_state(res["state"], ref_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("prefix", ["blocks", "blocks.0."], ids=["zero1 set", "zero2/3 layer group"])
def test_aligned_layout_keeps_matrices_whole(prefix):
    """GPT-3-blocks' Muon matrices (the ZeRO-1 set of the world-2 run) and one block's (a
    ZeRO-2/3 layer group) over 2 replicas."""
    case = _case("gpt3")
    from autopar.passes.zero_layout import aligned_offsets

    shapes = [tuple(p.shape) for f, p in case.model.named_parameters() if p.ndim == 2 and f.startswith(prefix)]
    sizes = [math.prod(s) for s in shapes]
    half = -(-sum(sizes) // 2)
    packed = [sum(sizes[:i]) for i in range(len(sizes))]
    assert any(o < half < o + n for o, n in zip(packed, sizes))  # the packed layout cuts one
    offsets, padded = aligned_offsets(shapes, 2)
    shard = padded // 2
    assert not any(o // shard != (o + n - 1) // shard for o, n in zip(offsets, sizes))
    spans = sorted((o, o + n) for o, n in zip(offsets, sizes))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert padded <= 1.25 * sum(sizes)


def test_zero2_deals_matrices_over_all_layers():
    """Llama-8B-shaped layers (7 matrices each) at dp=8: dealt per layer, whole matrices pad the
    shards to 2.15x the elements (a replica gets nothing); ZeRO-2, which gathers nothing per
    layer, deals the aligned set over all layers in one group (1.08x); ZeRO-3 keeps its layers."""
    from autopar.passes.zero_layout import ParamSpec, zero_layout

    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    specs = [ParamSpec(f"layers.{i}.m{j}.weight", s) for i in range(4) for j, s in enumerate(shapes)]
    specs += [ParamSpec(f"layers.{i}.norm.weight", (4096,)) for i in range(4)]
    option_of = {s.fqn: int(len(s.shape) == 2) for s in specs}
    numel = sum(math.prod(s) for s in shapes)  # one layer's matrices
    for zero, groups, pad in ((2, 1, 1.08), (3, 4, 2.16)):
        zl = zero_layout(specs, zero, 8, option_of=option_of, aligned={1})
        mats = [g for g in zl.groups if g.options == 1]
        assert len(mats) == groups
        assert sum(g.padded for g in mats) <= pad * 4 * numel
        for g in mats:  # every matrix inside one shard
            shard = g.padded // g.replicas
            assert all(o // shard == (o + math.prod(s) - 1) // shard for o, s in zip(g.offsets, g.shapes))
