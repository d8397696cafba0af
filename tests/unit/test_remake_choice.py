"""Issue 49 item 5: the backward's element-wise remaking is a choice. The profile holds each
unit both ways (kept from F, made again in I and W: ``UnitKind.remade``), and the search takes
the remaking form only where memory binds: with the limit between the two forms' peaks the
chosen layout remakes (and its Plan says so); with room for the kept form it does not."""
import pytest

from autopar.planner.devices import get_profile
from autopar.planner.estimate import Evaluator
from autopar.planner.layout import Layout, Partition
from autopar.planner.profile import profile_model
from autopar.planner.request import Candidate
from autopar.planner.search import _simulate, to_plan
from tests.models import make_llama


@pytest.fixture(scope="module")
def llama_profile():
    case = make_llama()
    return profile_model(case.model, case.inputs, case.target, case.loss_fn)


def test_each_unit_is_priced_both_ways(llama_profile):
    """A Llama block made again keeps less from F and does more memory-bound work in I (the
    roofline of the h100 profile); the profile's remade variant holds every unit that way."""
    dev = get_profile("h100")
    layers = [u.kind for u in llama_profile.units if u.name.startswith("layers.")]
    kind = layers[0]
    assert kind.remade is not None
    again = kind.remaking()
    assert again.saved_bytes < kind.saved_bytes
    assert again.times(dev, 1.0)[1] > kind.times(dev, 1.0)[1]
    remade = llama_profile.remade
    assert [u.name for u in remade.units] == [u.name for u in llama_profile.units]
    assert all(u.kind.remade is None for u in remade.units) and remade.remade is None


def test_the_search_remakes_only_where_memory_binds(llama_profile):
    dev = get_profile("h100")
    lay = Layout(pp=2, dp=1, cp=1, ep=1, schedule="1f1b", v=1, m=8, b=1, zero=0)
    part = Partition((0, 3, len(llama_profile.units)), (False, False))
    probe = Evaluator(llama_profile, dev, 1e15, 8, loss_chunking=False, offloading=False)
    kept, again = (max(e.evaluate(lay, part).peak_memory) for e in (probe, probe.remade))
    assert again < kept

    def chosen(limit):
        ev = Evaluator(llama_profile, dev, limit, 8, loss_chunking=False, offloading=False)
        c = Candidate(lay, "screened")
        _simulate(ev, c)
        return c

    roomy, tight = chosen(kept * 1.001), chosen((kept + again) / 2)
    assert roomy.status == tight.status == "feasible"
    assert not roomy.remake and not any(roomy.estimate.partition.recompute)
    assert tight.remake and not any(tight.estimate.partition.recompute)
    assert max(tight.estimate.peak_memory) <= (kept + again) / 2
    assert tight.time >= roomy.time
    ev = Evaluator(llama_profile, dev, (kept + again) / 2, 8, loss_chunking=False, offloading=False)
    plan = to_plan(ev, tight)
    assert plan.remake is True and all(plan.remakes(s) for s in range(plan.num_stages))
    assert to_plan(ev, roomy).remake is None and not plan.compile
