"""Averaging rules of Zhang et al. (Eq. 4, 5, 7) and the weight diversity of Eq. 8, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fedml_ssfl.aggregation import (
    fedavg_with_server,
    grouping_average,
    weight_diversity,
    weighted_average,
)


def st(*values, buf=0):
    return {"w": torch.tensor(values, dtype=torch.float32), "n": torch.tensor(buf)}


def test_eq4_server_counts_as_one_model():
    server = st(0.0, 3.0)
    clients = [st(3.0, 0.0), st(6.0, 3.0)]
    out = fedavg_with_server(server, clients)
    assert torch.allclose(out["w"], torch.tensor([3.0, 2.0]))  # (0+3+6)/3, (3+0+3)/3


def test_eq5_with_sampled_clients_matches_formula():
    server = st(1.0)
    sampled = [st(2.0), st(4.0), st(7.0)]
    out = fedavg_with_server(server, sampled)
    assert out["w"].item() == pytest.approx((1 + 2 + 4 + 7) / (3 + 1))


def test_eq7_groups_average_with_server_then_mean():
    server = st(0.0)
    g1 = [st(4.0), st(8.0)]  # (0+4+8)/3 = 4
    g2 = [st(10.0)]  # (0+10)/2 = 5
    avgs, glob = grouping_average(server, [g1, g2])
    assert [a["w"].item() for a in avgs] == pytest.approx([4.0, 5.0])
    assert glob["w"].item() == pytest.approx(4.5)
    # differs from plain FedAvg over the same models: (0+4+8+10)/4 = 5.5
    assert fedavg_with_server(server, g1 + g2)["w"].item() == pytest.approx(5.5)


def test_integer_buffers_take_the_maximum_and_weights_normalise():
    out = weighted_average([st(0.0, buf=3), st(10.0, buf=5)], weights=[3, 1])
    assert out["w"].item() == pytest.approx(2.5)
    assert out["n"].item() == 5


def test_weight_diversity_by_hand():
    before = {"w": torch.zeros(2)}
    same = [{"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])}]
    assert weight_diversity(before, same) == pytest.approx(0.5)  # n equal updates -> 1/n
    opposite = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 1.0])}]
    # sum ||g||^2 = 2 ; ||sum g||^2 = 2
    assert weight_diversity(before, opposite) == pytest.approx(1.0)
    cancel = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([-1.0, 0.0])}]
    assert math.isnan(weight_diversity(before, cancel))


def test_weight_diversity_restricted_to_keys():
    before = {"a": torch.zeros(1), "fc.weight": torch.zeros(1)}
    after = [
        {"a": torch.tensor([5.0]), "fc.weight": torch.tensor([1.0])},
        {"a": torch.tensor([-5.0]), "fc.weight": torch.tensor([1.0])},
    ]
    assert weight_diversity(before, after, ["fc.weight"]) == pytest.approx(0.5)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="nothing to average"):
        weighted_average([])
    with pytest.raises(ValueError, match="shape"):
        weighted_average([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}])


def bn(w, mean, count):
    return {
        "w": torch.tensor([w]),
        "bn.running_mean": torch.tensor([mean]),
        "bn.num_batches_tracked": torch.tensor(count),
    }


def test_keys_average_only_the_parameters_and_keep_the_first_models_buffers():
    server, clients = bn(0.0, -1.0, 7), [bn(3.0, 10.0, 9), bn(6.0, 20.0, 11)]
    out = fedavg_with_server(server, clients, keys=["w"])
    assert out["w"].item() == pytest.approx(3.0)  # (0 + 3 + 6) / 3
    assert out["bn.running_mean"].item() == -1.0 and out["bn.num_batches_tracked"].item() == 7  # the server's
    assert out["bn.running_mean"] is not server["bn.running_mean"]  # a copy, not the server's tensor
    every = fedavg_with_server(server, clients)  # the default averages every floating tensor
    assert every["bn.running_mean"].item() == pytest.approx(29 / 3) and every["bn.num_batches_tracked"].item() == 11
    avgs, glob = grouping_average(server, [clients[:1], clients[1:]], keys=["w"])
    assert [a["w"].item() for a in avgs] == pytest.approx([1.5, 3.0]) and glob["w"].item() == pytest.approx(2.25)
    assert all(m["bn.running_mean"].item() == -1.0 for m in [*avgs, glob])
    with pytest.raises(ValueError, match="not in the state dicts"):
        weighted_average([server], keys=["nope"])


def test_weighted_average_is_the_float64_formula_bit_for_bit():
    """The buffered accumulation (issue 15) gives acc += float64(s) * (w / total), in order, exactly."""
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(7, 5, generator=g) * 10.0**i, "b": torch.randn(5, generator=g)} for i in range(3)]
    states[1]["w"][0, :2] = -0.0
    weights = [1.0, 2.5, 0.3]
    out = weighted_average(states, weights)
    total = sum(weights)
    for k in ("w", "b"):
        acc = torch.zeros_like(states[0][k], dtype=torch.float64)
        for s, w in zip(states, weights):
            acc = acc + s[k].to(torch.float64) * (w / total)
        assert torch.equal(out[k], acc.to(torch.float32)) and out[k].dtype == torch.float32
