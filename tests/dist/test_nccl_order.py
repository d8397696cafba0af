"""Issue 48, N1: pipeline P2P as NCCL runs it, on gloo. Every P2P tag is 0 (the runtime's
default, collectives/comms.py: gloo then matches each channel's messages first-in, first-out, as
NCCL matches them by order), one channel per direction of a pair of ranks, and receives posted
where the lowered program puts them (``AUTOPAR_P2P_PREFETCH=0``, as on GPUs). HF Llama trains
exactly against eager under every schedule at pp=2, under zbv, dualpipev and interleaved-1f1b
at pp=4, and under zbv at pp=2 x dp=2 with ZeRO-3. (dualpipev at pp=2 x dp=2 x ep=2 on MoE runs
tag-free in tests/dist/test_hf_expert_parallel.py.)"""
import functools

import pytest
import torch

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto", "zbv", "v-half", "v-min",
                 "dualpipev")
MATRIX = {
    2: [dict(pp=2, schedule=s, num_microbatches=4) for s in ALL_SCHEDULES],
    4: [dict(pp=4, schedule=s, num_microbatches=8) for s in ("zbv", "dualpipev", "interleaved-1f1b")]
    + [dict(pp=2, dp=2, schedule="zbv", num_microbatches=4, zero=3)],
}
SGD = functools.partial(torch.optim.SGD, lr=0.5)


def _train(rank, world, plans):
    import os
    import traceback

    import autopar
    from autopar.collectives import comms
    from tests.dist.harness import reuse_captures
    from tests.hf_models import make_hf

    os.environ["AUTOPAR_P2P_PREFETCH"] = "0"
    assert not comms.p2p_tags_enabled()
    reuse_captures()
    out = []
    try:
        for plan in plans:
            try:
                case = make_hf("llama", seed=0)
                pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=SGD,
                                         plan=autopar.Plan(**plan), example_target=case.target, timeout=60)
                assert not pm.built.executor._prefetch and not pm.built.executor._tagged
                out.append({"losses": [pm.step(case.inputs, case.target) for _ in range(2)],
                            "state": pm.state_dict()})
            except Exception:  # noqa: BLE001 - report per sub-case
                out.append({"traceback": traceback.format_exc()})
    finally:
        del os.environ["AUTOPAR_P2P_PREFETCH"]
    return out


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_tag_free_pipelines_match_eager(world):
    from tests.hf_models import make_hf
    from tests.reference import assert_close_state, eager_reference

    per_rank = run_shared(_train, world, MATRIX[world], deadline_s=600)
    failures = []
    for i, plan in enumerate(MATRIX[world]):
        case = make_hf("llama", seed=0)
        ref_losses, ref_state = eager_reference(case.model, case.inputs, case.target, case.loss_fn, SGD,
                                                dp=plan.get("dp", 1), num_microbatches=plan["num_microbatches"],
                                                steps=2)
        for r in range(world):
            try:
                res = per_rank[r][i]
                assert "traceback" not in res, f"rank {r}:\n{res.get('traceback')}"
                for got, want in zip(res["losses"], ref_losses):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
                assert_close_state(res["state"], ref_state, rtol=1e-4)
            except AssertionError as e:
                failures.append(f"{plan} rank {r}: {e}")
    assert not failures, "\n\n".join(failures)
