from __future__ import annotations

import math

import pytest
import torch

from rstar_pipelines.training.ppm import pair_weight, pairwise_loss


def test_weighs_each_pair_by_its_counts_and_averages():
    r_pos = torch.tensor([1.0, 0.0, 2.0])
    r_neg = torch.tensor([0.0, 0.0, -1.0])
    weights = torch.tensor([pair_weight(2, 2), pair_weight(0, 3), pair_weight(1, 4)])
    assert weights.tolist() == pytest.approx([1 / 4, 1 / 3, 1 / 4])
    loss = pairwise_loss(r_pos, r_neg, weights)
    # -log(sigmoid(d)) = log(1 + exp(-d)), weighted, then the mean over the 3 pairs
    expected = (math.log1p(math.exp(-1)) / 4 + math.log(2) / 3 + math.log1p(math.exp(-3)) / 4) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_gradient_pushes_the_chosen_value_up():
    r_pos = torch.zeros(1, requires_grad=True)
    r_neg = torch.zeros(1, requires_grad=True)
    pairwise_loss(r_pos, r_neg, torch.tensor([pair_weight(1, 1)])).backward()
    # d/dx log(1 + exp(-x)) at 0 is -1/2
    assert r_pos.grad.item() == pytest.approx(-0.5)
    assert r_neg.grad.item() == pytest.approx(0.5)
