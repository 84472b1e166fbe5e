"""FedAvg's averaging operator against hand-computed values, BatchNorm buffers included."""

import pytest
import torch
from torch import nn

from fedfuse.fusion.average import add_scaled, delta, weighted_average


def _bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))
    net.train()
    net(torch.randn(4, 1, 4, 4) * (seed + 1))  # moves running statistics and num_batches_tracked
    if seed == 1:
        net(torch.randn(4, 1, 4, 4))  # client 1 saw two batches
    return net


def test_weighted_average_matches_hand_computation_including_bn_buffers():
    a, b = _bn_net(0).state_dict(), _bn_net(1).state_dict()
    avg = weighted_average([a, b], [30.0, 10.0])
    assert set(avg) == set(a)
    for k in a:
        if k.endswith("num_batches_tracked"):
            assert avg[k].dtype == torch.long
            assert int(avg[k]) == max(int(a[k]), int(b[k])) == 2
        else:
            expected = 0.75 * a[k] + 0.25 * b[k]
            torch.testing.assert_close(avg[k], expected, rtol=0, atol=1e-7)
    # the BN statistics really were averaged (not copied from one client)
    rm = "1.running_mean"
    assert not torch.equal(avg[rm], a[rm]) and not torch.equal(avg[rm], b[rm])
    rv = "1.running_var"
    torch.testing.assert_close(avg[rv], 0.75 * a[rv] + 0.25 * b[rv])


@pytest.mark.parametrize(("policy", "expected"), [("max", 2), ("sum", 3), ("first", 1)])
def test_num_batches_tracked_policies(policy, expected):
    a, b = _bn_net(0).state_dict(), _bn_net(1).state_dict()
    avg = weighted_average([a, b], [1, 1], base=a, int_policy=policy)
    assert int(avg["1.num_batches_tracked"]) == expected


def test_keys_missing_from_some_clients_average_over_holders_and_untrained_keep_base():
    base = {"w": torch.zeros(2), "u": torch.full((2,), 7.0)}
    s1 = {"w": torch.tensor([1.0, 2.0])}
    s2 = {"w": torch.tensor([3.0, 6.0])}
    s3 = {}  # a client that trained nothing of these
    out = weighted_average([s1, s2, s3], [1.0, 3.0, 5.0], base=base)
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(out["u"], base["u"])  # nobody trained it: unchanged


def test_single_state_is_identity_and_dtype_kept():
    s = {"w": torch.randn(3, dtype=torch.float64), "n": torch.tensor(5)}
    out = weighted_average([s], [4.0])
    assert out["w"].dtype == torch.float64
    torch.testing.assert_close(out["w"], s["w"], rtol=0, atol=0)
    assert int(out["n"]) == 5


def test_delta_and_add_scaled_roundtrip():
    a = {"w": torch.randn(4), "n": torch.tensor(3)}
    b = {"w": torch.randn(4), "n": torch.tensor(5)}
    d = delta(b, a)
    back = add_scaled(a, d, 1.0)
    torch.testing.assert_close(back["w"], b["w"])
    assert int(back["n"]) == 5


def test_bad_weights_rejected():
    with pytest.raises(ValueError, match="weights"):
        weighted_average([{"w": torch.ones(1)}], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average([{"w": torch.ones(1)}], [-1.0])
