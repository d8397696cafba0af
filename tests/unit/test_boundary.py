"""runtime/boundary.py and StageWork.with_strides: a stage input of any layout survives the
wire (pack on the sender, a dense buffer, unpack and the traced strides on the receiver) with
the same values and the traced layout (hypothesis over shapes, broadcast dims, permutations
and dtypes)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.runtime.boundary import wire_of
from autopar.runtime.stage_work import with_strides

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


@st.composite
def layouts(draw):
    ndim = draw(st.integers(0, 4))
    shape = [draw(st.integers(1, 4)) for _ in range(ndim)]
    base_shape = [1 if draw(st.booleans()) else n for n in shape]  # dims of size 1 get broadcast
    perm = draw(st.permutations(range(ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    return shape, base_shape, perm, dtype


@settings(max_examples=80)
@given(layouts())
def test_a_tensor_of_any_layout_crosses_the_wire_unchanged(layout):
    shape, base_shape, perm, dtype = layout
    base = (torch.randn([base_shape[p] for p in perm]) * 3).to(dtype)
    inv = [perm.index(d) for d in range(len(perm))]
    value = base.permute(inv).expand(shape) if shape else base  # permuted, then broadcast: what a producer leaves
    wire = wire_of(value)  # the receiving stage traced this layout
    sent = wire.pack(value)
    assert sent.is_contiguous() and tuple(sent.shape) == wire.shape
    assert sent.numel() <= max(value.numel(), 1)
    buf = torch.empty(wire.shape, dtype=wire.dtype)  # the receiver's dense buffer
    buf.copy_(sent)
    got = with_strides(wire.unpack(buf), tuple(value.stride()))
    assert got.dtype == value.dtype and tuple(got.shape) == tuple(value.shape)
    assert torch.equal(got, value)
    for d, (n, s) in enumerate(zip(value.shape, value.stride())):  # the traced layout is back
        if n > 1:
            assert got.stride()[d] == s, (got.stride(), value.stride())


def test_a_broadcast_mask_travels_as_one_slice():
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].expand(8, 1, 16, 16)
    wire = wire_of(mask)
    assert wire.shape == (1, 1, 16, 16) and wire.pack(mask).numel() == 256
