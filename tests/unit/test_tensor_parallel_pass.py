"""T4: what the tensor-parallel pass (passes/tensor_parallel.py) shards and what it keeps
replicated, on captures of small models (no process group): the sharded linears against the
hand-written Megatron assignment, and one replicated fallback of each kind of issue 38 item 2
(heads or FFN width tp does not divide, a packed weight without a rule, a norm over the sharded
dim, dropout in a sharded region, a weight used twice), each with the reason it logs; the shard
mapping of a packed weight against a brute force."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import passes
from autopar.passes.tensor_parallel import TpShard, analyze
from tests.models import Llama, make_llama


def _analysis(model, x, tp):
    captured = passes.capture(model, (x,), None, None)
    an, replicated = analyze(captured, tp)
    name = {ph: fqn.rsplit(".", 1)[0] for ph, fqn in captured.params.items()}
    cols = sorted(name[lin.weight.name] for lin in an.columns.values())
    rows = sorted(name[lin.weight.name] for lin in an.rows.values())
    return cols, rows, replicated


class _Block(nn.Module):
    """Attention (``heads`` heads of 4) and an MLP (``ffn`` wide) with optional oddities."""

    def __init__(self, heads=2, ffn=8, dropout=0.0, mlp_norm=False, packed_view=False, tied=False):
        super().__init__()
        d = 8
        self.heads, self.packed_view = heads, packed_view
        self.qkv = nn.Linear(d, 3 * heads * 4)
        self.out = nn.Linear(heads * 4, d)
        self.up = nn.Linear(d, ffn)
        self.down = nn.Linear(ffn, d)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(ffn) if mlp_norm else nn.Identity()
        if tied:
            self.down.weight = nn.Parameter(self.up.weight.detach().t().clone())
            self.up2 = nn.Linear(d, ffn, bias=False)
            self.up2.weight = self.up.weight

    def forward(self, x):
        b, t, _ = x.shape
        h = self.heads
        if self.packed_view:  # [b, t, 3, H, D] then unbind: the packed dim is split by a view, not a split
            q, k, v = self.qkv(x).view(b, t, 3, h, 4).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (y.view(b, t, h, 4).transpose(1, 2) for y in self.qkv(x).split(h * 4, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h * 4)
        x = x + self.out(y)
        up = self.up(x)
        if hasattr(self, "up2"):
            up = up + self.up2(x)
        return (x + self.down(self.drop(self.norm(F.gelu(up))))).sum()


X = torch.randn(2, 4, 8)


def test_llama_shards_as_megatron_does():
    case = make_llama()
    captured = passes.capture(case.model, case.inputs, case.target, case.loss_fn)
    an, replicated = analyze(captured, 2)
    cols = {captured.params[lin.weight.name].split(".")[-2] for lin in an.columns.values()}
    rows = {captured.params[lin.weight.name].split(".")[-2] for lin in an.rows.values()}
    layers = len(case.model.layers)
    assert (len(an.columns), len(an.rows)) == (5 * layers + 1, 2 * layers)  # + the LM head
    assert cols == {"wq", "wk", "wv", "w1", "w3", "output"} and rows == {"wo", "w2"}
    # the token embedding by vocabulary, the LM head by columns: its logits reach the cross-entropy,
    # which becomes the vocabulary-parallel one; nothing stays replicated
    assert set(an.vocab.values()) == {next(n for n in captured.gm.graph.nodes if captured.params.get(n.name) ==
                                           "tok_embeddings.weight")}
    assert any(captured.params[lin.weight.name] == "output.weight" for lin in an.columns.values()) and not replicated


def test_gqa_with_fewer_key_value_heads_than_tp_reads_them_replicated():
    """The repository's Llama (4 query heads over 2 key/value heads, repeat_interleave) at tp=4:
    the k/v projections stay replicated (2 heads over 4 ranks), the attention is head-sharded and
    each rank reads its query heads' block of the repeated keys and values (a narrow each)."""
    case = make_llama()
    captured = passes.capture(case.model, case.inputs, case.target, case.loss_fn)
    an, _ = analyze(captured, 4)
    cols = {captured.params[lin.weight.name].split(".")[-2] for lin in an.columns.values()}
    assert cols == {"wq", "w1", "w3", "output"} and len(an.rows) == 2 * len(case.model.layers)
    sdpa = [n for n in an.narrows if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == len(case.model.layers) and all(
        [(a, d, b) for a, d, b in an.narrows[n]] == [(n.args[1], 1, 4), (n.args[2], 1, 4)] for n in sdpa)


def test_packed_qkv_split_and_both_mlps_shard():
    cols, rows, replicated = _analysis(_Block(), X, 2)
    assert cols == ["qkv", "up"] and rows == ["down", "out"] and not replicated


@pytest.mark.parametrize("kwargs, tp, kept, why", [
    (dict(heads=3), 2, ["down", "up"], "does not divide"),                 # 3 heads over tp=2
    (dict(packed_view=True), 2, ["down", "up"], "does not divide"),        # [.., 3, H, D]: no rule for the 3
    (dict(mlp_norm=True), 2, ["out", "qkv"], "layer_norm over the sharded dim"),  # LayerNorm over the FFN width
    (dict(dropout=0.1), 2, ["out", "qkv"], "random numbers"),              # dropout between up and down
])
def test_replicated_fallbacks_say_why(kwargs, tp, kept, why):
    model = _Block(**kwargs)
    model.train()
    cols, rows, replicated = _analysis(model, X, tp)
    assert sorted(cols + rows) == kept, (cols, rows, replicated)
    assert replicated and why in replicated[0], replicated  # (then the linears after it, as columns of their own)


def test_width_tp_does_not_divide_and_tied_weights_stay_replicated():
    cols, rows, _ = _analysis(_Block(heads=2, ffn=6), X, 4)  # 6 FFN columns, 8 q/k/v columns over tp=4
    assert "up" not in cols and "down" not in rows
    cols, rows, _ = _analysis(_Block(tied=True), X, 2)  # up's weight is also up2's
    assert "up" not in cols and "up2" not in cols and "down" not in rows


@pytest.mark.parametrize("parts, dim", [((), 0), ((8, 4, 4), 0), ((6, 6), 1)])
def test_shard_blocks_rebuild_the_whole(parts, dim):
    shape = (16, 12) if dim == 0 else (4, 12)
    whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
    tp = 2
    blocks = [TpShard("w", dim, shape, tp, r, parts).local(whole) for r in range(tp)]
    # by hand: rank r holds block r of every part, parts in order
    starts, sizes = ([0], [shape[dim]]) if not parts else ([sum(parts[:i]) for i in range(len(parts))], parts)
    for r, blk in enumerate(blocks):
        want = torch.cat([whole.narrow(dim, a + r * n // tp, n // tp) for a, n in zip(starts, sizes)], dim)
        assert torch.equal(blk, want)
    assert torch.equal(TpShard("w", dim, shape, tp, 0, parts).whole(blocks), whole)
    for r, blk in enumerate(blocks):  # the block read piece by piece (meta builds from a file)
        pieces = TpShard("w", dim, shape, tp, r, parts).pieces()
        assert len(pieces) == max(1, len(parts)) and torch.equal(torch.cat([whole[x] for x in pieces], dim), blk)


def test_hugging_face_tp_plan_is_compared_not_followed():
    """HF Llama's own plan (``_tp_plan``) shards q/k/v/gate/up by columns, o/down by rows, the
    embedding by vocabulary and the LM head by columns, as the graph does at tp=2; at tp=4 its 2
    key/value heads do not divide, so the pass keeps k_proj and v_proj replicated (the attention
    reads them per rank): exactly those are reported, per layer."""
    from autopar.passes.tensor_parallel import tp_plan_disagreements
    from tests.hf_models import make_hf

    case = make_hf("llama", batch=2, seq=8, use_cache=False)
    captured = passes.capture(case.model, case.inputs, case.target, case.loss_fn)
    an, _replicated = analyze(captured, 2)
    assert tp_plan_disagreements(case.model, an.roles(captured.params)) == []
    an, _replicated = analyze(captured, 4)
    lines = tp_plan_disagreements(case.model, an.roles(captured.params))
    assert sorted(line.split(":")[0] for line in lines) == [f"model.layers.{i}.self_attn.{p}_proj"
                                                            for i in range(2) for p in "kv"], lines
    assert all("keeps it replicated" in line for line in lines)


def _sequence(model, inputs, target, loss_fn, tp):
    from autopar.passes.sequence_parallel import placement
    from autopar.passes.tensor_parallel import apply_tensor_parallel

    captured = passes.capture(model, inputs, target, loss_fn)
    return placement(apply_tensor_parallel(captured, tp, 0, "g").captured.gm.graph, tp)


def test_sequence_parallel_cuts_the_residual_stream_along_the_tokens():
    """The repository's Llama at tp=2 (by hand: L layers of two row sums, two column inputs,
    the vocabulary-parallel embedding's sum and the LM head's input): every sum reduce-scattered,
    every column input all-gathered, nothing gathered whole or cut. Without the vocabulary-parallel
    embedding (tp=2 over a vocabulary of 255: no) its output is cut where it is made, and the
    final norm's output is gathered whole for the replicated LM head."""
    case = make_llama()
    layers = len(case.model.layers)
    p = _sequence(case.model, case.inputs, case.target, case.loss_fn, 2)
    assert (len(p.seeds), len(p.gathered)) == (2 * layers + 1, 2 * layers + 1)
    assert not p.sources and not p.gathers and not p.splits
    torch.manual_seed(0)
    odd = Llama(vocab_size=255, seq_len=32)
    tokens = torch.randint(0, 255, (2, 33))
    p = _sequence(odd, (tokens[:, :-1],), tokens[:, 1:], lambda out, t: F.cross_entropy(out.flatten(0, 1),
                                                                                      t.flatten()), 2)
    assert (len(p.seeds), len(p.gathered)) == (2 * layers, 2 * layers)
    assert [x.target for x in p.sources] == [torch.ops.aten.embedding.default]
    assert [[a.target for a in ins] for ins in p.gathers.values()] == [[torch.ops.aten.mul.Tensor]]  # RMSNorm's
    assert not p.splits  # (every cut value is cut where it is made)


class _Mlp(nn.Module):
    """x + dropout(down(gelu(up(x)))): one column, one row without bias."""

    def __init__(self, dropout):
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(8, 16), nn.Linear(16, 8, bias=False), nn.Dropout(dropout)

    def forward(self, x):
        return (x + self.drop(self.down(F.gelu(self.up(x))))).sum()


@pytest.mark.parametrize("x, dropout, seeds", [
    (torch.randn(1, 3, 8), 0.0, 0),  # 3 tokens, tp=2: no token dim tp divides: the sum stays an all-reduce
    (torch.randn(2, 4, 8), 0.1, 0),  # the sum's only reader is dropout (no token rule): kept an all-reduce
    (torch.randn(2, 4, 8), 0.0, 1),
])
def test_sequence_parallel_keeps_all_reduces_where_tokens_do_not_split(x, dropout, seeds):
    model = _Mlp(dropout)
    model.train()
    p = _sequence(model, (x,), None, None, 2)
    assert len(p.seeds) == seeds and len(p.gathered) == seeds, p
