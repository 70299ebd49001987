"""Loss-decay weights and the weighted block loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_dflash.train.loss import block_loss, decay_weights, default_decay_gamma


@pytest.mark.parametrize(("block", "decay_gamma"), [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_paper_defaults(block, decay_gamma):
    assert default_decay_gamma(block) == decay_gamma
    w = decay_weights(block, default_decay_gamma(block))
    assert w.shape == (block - 1,)
    expected = [math.exp(-(k - 1) / decay_gamma) for k in range(1, block)]
    torch.testing.assert_close(w, torch.tensor(expected))


def test_decay_gamma_between_and_beyond_paper_settings():
    values = [default_decay_gamma(b) for b in range(2, 33)]
    assert values == sorted(values), "longer blocks decay more slowly"
    assert default_decay_gamma(12) == pytest.approx(5 + 2 / 6 * 2)
    assert default_decay_gamma(4) == 2.0 and default_decay_gamma(32) == 14.0


def test_no_decay_is_uniform():
    assert torch.equal(decay_weights(8, None), torch.ones(7))


def test_block_loss_is_weighted_mean_over_labelled_slots():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 11)
    labels = torch.randint(0, 11, (2, 3, 4))
    labels[1, 2] = -100
    labels[0, 1, 3] = -100
    w = decay_weights(5, 2.0)
    loss, acc = block_loss(logits, labels, w)
    num = den = 0.0
    for b in range(2):
        for n in range(3):
            for k in range(4):
                if labels[b, n, k] == -100:
                    continue
                ce = F.cross_entropy(logits[b, n, k][None], labels[b, n, k][None])
                num += w[k] * ce
                den += w[k]
    torch.testing.assert_close(loss, torch.as_tensor(num / den))
    hits = (logits.argmax(-1) == labels) & (labels != -100)
    torch.testing.assert_close(acc, hits.sum((0, 1)) / (labels != -100).sum((0, 1)))
