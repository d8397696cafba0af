"""T1: tensor parallelism (passes/tensor_parallel.py) over gloo, exact against one eager process.

``Plan(tp=2)`` on 2 processes: Hugging Face Llama, Qwen2 and GPT-2 (``Conv1D``: transposed
weights, the packed q/k/v projection) and this repository's GPT and Llama; two SGD steps against
tests/reference.py's eager run (design.md §5: losses to 1e-5, parameters after the steps to 1e-5
relative). What the pass did is read off the programs too: per transformer layer the forward
holds two ``tp_reduce`` (the row linears' sums), I two (the column inputs' gradients) and W none.
One process group per world size runs every sub-case; a sub-case's exception is reported with
its traceback and the others go on.
"""
import pytest

from tests.dist.harness import run_shared

pytestmark = pytest.mark.slow

BATCH, SEQ, STEPS, M = 4, 16, 2, 2
# (model, plan kwargs) per world size
CASES = {2: [("llama", dict(tp=2)), ("qwen2", dict(tp=2)), ("gpt2", dict(tp=2)), ("gpt", dict(tp=2)),
             ("tiny_llama", dict(tp=2)), ("mixtral", dict(tp=2))],
         4: [("llama", dict(pp=2, tp=2, schedule="zbv", num_microbatches=4)),
             ("qwen2", dict(dp=2, tp=2, zero=3))]}

# the tp all-reduces of a forward, by hand: 2 per layer (llama, qwen2, gpt2, mixtral: 2 layers;
# gpt, tiny_llama: 4), Mixtral's MoE layers 1 (attention only)
REDUCES = {"llama": 4, "qwen2": 4, "gpt2": 4, "gpt": 8, "tiny_llama": 8, "mixtral": 2}


def _case(name):
    from tests.hf_models import make_hf
    from tests.models import make_gpt, make_llama

    if name == "gpt":
        return make_gpt(seed=3)
    if name == "tiny_llama":
        return make_llama(seed=3)
    return make_hf(name, seed=3, batch=BATCH, seq=SEQ, use_cache=False)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.5)


def _reduces(program) -> dict:
    """How many tp all-reduces each of a stage's programs (F, I, W) holds."""
    return {kind: sum(n.op == "call_function" and "tp_reduce" in str(n.target)
                      for n in getattr(program, kind.lower()).gm.graph.nodes)
            for kind in ("F", "I", "W")}


def _train_many(rank, world, cases):
    import time
    import traceback

    import torch

    import autopar

    out = {}
    for name, plan_kwargs in cases:
        t0 = time.perf_counter()
        try:
            case = _case(name)
            pm = autopar.parallelize(case.model, case.inputs, loss_fn=case.loss_fn, optimizer=_sgd,
                                     plan=autopar.Plan(**{"num_microbatches": M, **plan_kwargs}), example_target=case.target)
            losses = [pm.step(case.inputs, case.target) for _ in range(STEPS)]
            tp = pm.built.parallelisms["tp"]
            out[name] = {"losses": losses, "state": {k: v.clone() for k, v in pm.state_dict().items()},
                         "programs": {s: _reduces(p) for s, p in enumerate(pm.built.programs)
                                      if s in pm.built.parallelisms["pp"].my_stages},
                         "sharded": len(tp.shards),
                         "local_bytes": sum(p.numel() * p.element_size() for p in pm.model.parameters()
                                            if not p.is_meta),
                         "s": time.perf_counter() - t0}
        except Exception:  # noqa: BLE001 - report per sub-case, keep going
            out[name] = traceback.format_exc()
    torch.distributed.barrier()
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_tensor_parallel_matches_eager(world):
    import torch

    from tests.reference import assert_close_state, eager_reference

    per_rank = run_shared(_train_many, world, CASES[world], deadline_s=600, reuse=False)
    failures = []
    for name, plan_kwargs in CASES[world]:
        try:
            case = _case(name)
            whole = sum(p.numel() * p.element_size() for p in case.model.parameters())
            ref_losses, ref_state = eager_reference(case.model, case.inputs, case.target, case.loss_fn, _sgd,
                                                    dp=plan_kwargs.get("dp", 1),
                                                    num_microbatches=plan_kwargs.get("num_microbatches", M),
                                                    steps=STEPS)
            for r in range(world):
                res = per_rank[r][name]
                assert isinstance(res, dict), f"rank {r} raised:\n{res}"
                for step, want in enumerate(ref_losses):
                    torch.testing.assert_close(res["losses"][step], want, rtol=1e-5, atol=0,
                                               msg=lambda m: f"rank {r} step {step} loss: {m}")
                assert_close_state(res["state"], ref_state)
            res = per_rank[world - 1][name]
            programs = {s: c for r in range(world) for s, c in per_rank[r][name]["programs"].items()}
            print(f"{name} {plan_kwargs}: {res['sharded']} parameters sharded, {programs}, "
                  f"{res['local_bytes'] / whole:.2f} of the bytes, {res['s']:.1f} s")
            # per transformer layer: two sums in F (attention and MLP outputs; Mixtral's experts
            # stay replicated: one), as many in I (their inputs' gradients), none in W
            # (a stage cut inside a layer puts a column's input gradient and the row's sum on two stages)
            assert sum(c["F"] for c in programs.values()) == REDUCES[name], programs
            assert sum(c["I"] for c in programs.values()) == REDUCES[name], programs
            assert all(c["W"] == 0 for c in programs.values()), programs
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name} {plan_kwargs}: {e}")
    assert not failures, "\n\n".join(failures)
