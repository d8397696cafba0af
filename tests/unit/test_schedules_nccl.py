"""schedules/nccl.py (issue 48, N2): the model of NCCL's point-to-point rules rejects what NCCL
would crash or hang on, by name, and accepts what it runs. The property tests
(test_schedules_properties.py) run it on every generated schedule."""
import pytest

from autopar.schedules import Action, build, check_nccl, lower

A = Action.parse


def _progs(*ranks: str):
    """Programs from text: actions separated by spaces, a batch joined by '+'."""
    return [tuple(tuple(A(x) for x in item.split("+")) if "+" in item else A(item) for item in r.split())
            for r in ranks]


def test_rejects_a_pair_whose_send_and_receive_orders_differ():
    """Rank 0 sends the activations of microbatches 0 then 1; rank 1 receives 1 then 0: NCCL
    hands microbatch 0's tensor to the receive of microbatch 1."""
    progs = _progs("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0",
                   "1RECV_F1 1RECV_F0 1F0 1F1 1B1 1SEND_B1 1B0 1SEND_B0")
    with pytest.raises(ValueError, match=r"ranks 0 -> 1: message 0 is 0SEND_F0 .* receive 0 is 1RECV_F1"):
        check_nccl(progs, (0, 1), 2)
    with pytest.raises(ValueError, match="ranks 0 -> 1"):
        check_nccl(progs, (0, 1), 2, layout="pair")


# Both ranks post a send to the other before their receive (1F1B's steady state as lowered):
# stage 0 sends microbatch 1's activations, then waits for microbatch 0's gradient; stage 1
# sends microbatch 0's gradient, then receives microbatch 1's activations.
CROSSING = ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
            "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")


def test_rejects_two_unbatched_sends_that_cross_on_one_communicator():
    with pytest.raises(ValueError, match=r"hang .*pair channels.*rank 0 waits at position 5 \(0B0\) for gradients "
                                         r"of stage 1 mb 0.*0SEND_F1 .* waits for 1RECV_F1"):
        check_nccl(_progs(*CROSSING), (0, 1), 2, layout="pair")


def test_accepts_the_crossing_sends_batched_or_on_a_channel_per_direction():
    batched = ("0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0RECV_B1 0B1",
               "1RECV_F0 1F0 1B0 1SEND_B0+1RECV_F1 1F1 1B1 1SEND_B1")
    assert check_nccl(_progs(*batched), (0, 1), 2, layout="pair")
    assert check_nccl(_progs(*CROSSING), (0, 1), 2, layout="direction")


def test_rejects_a_receive_never_sent_and_a_wait_that_never_ends():
    with pytest.raises(ValueError, match="1 sends but 0 receives"):
        check_nccl(_progs("0F0 0SEND_F0", "1F0"), (0, 1), 2)
    # rank 0 sends its activations only after the backward that needs rank 1's gradient of them
    with pytest.raises(ValueError, match=r"rank 0 waits at position 2 \(0B0\) for gradients of stage 1 mb 0.*"
                                         r"rank 1 waits at position 1 \(1F0\) for activations of stage 0 mb 0"):
        check_nccl(_progs("0F0 0RECV_B0 0B0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"), (0, 1), 2)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_dualpipev_pairs_receive_in_the_order_their_peer_sends(pp, m):
    """An F&B unit's two sends go out at one time: the receiver posts them F first, as sent
    (they were ordered by name before, and gloo with tags 0 aborted on the swapped pair)."""
    s = build("dualpipev", pp, m)
    assert check_nccl(lower(s).actions, s.stage_to_rank, s.num_stages)
