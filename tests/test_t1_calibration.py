"""benchmarks/t1_calibration.py: the overlap and expected-tau arithmetic against hand-computed cases."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch


def _module():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "t1_calibration.py"
    spec = importlib.util.spec_from_file_location("t1_calibration", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_is_the_acceptance_probability_of_speculative_sampling():
    """p = (0.5, 0.3, 0.2); q = (0.2, 0.2, 0.6): sum min = 0.2 + 0.2 + 0.2 = 0.6, and a draft whose
    argmax is token 2 is kept with p = 0.2. Checked against a Monte Carlo of the accept rule."""
    cal = _module()
    p = torch.tensor([0.5, 0.3, 0.2]).log().view(1, 1, 3)
    q = torch.tensor([0.2, 0.2, 0.6]).log().view(1, 1, 3)
    ov = cal.overlaps(p, q, temperature=1.0, draft_temps=[1.0])
    assert ov.shape == (2, 1, 1)
    assert ov[0].item() == pytest.approx(0.6, abs=1e-6) and ov[1].item() == pytest.approx(0.2, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(q.exp().view(-1), 200_000, replacement=True, generator=g)
    pv, qv = p.exp().view(-1), q.exp().view(-1)
    kept = (torch.rand(x.shape[0], generator=g) * qv[x] < pv[x]).float().mean().item()
    assert kept == pytest.approx(0.6, abs=0.005)
    # a draft temperature rescales the draft's logits only: at t = 2, q ~ sqrt(q)
    half = q.exp().sqrt() / q.exp().sqrt().sum()
    want = torch.minimum(p.exp(), half).sum().item()
    assert cal.overlaps(p, q, 1.0, [2.0])[0].item() == pytest.approx(want, abs=1e-6)


def test_expected_tau_sums_the_products_of_the_slots_kept_so_far():
    """Overlaps 0.5, 0.4, 0.9 along a block: 1 + 0.5 + 0.5*0.4 + 0.5*0.4*0.9 = 1.88; a slot past the
    answer (masked) ends the chain."""
    cal = _module()
    ov = torch.tensor([[0.5, 0.4, 0.9]])
    assert cal.expected_tau(ov, torch.ones(1, 3)).item() == pytest.approx(1.88)
    assert cal.expected_tau(ov, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(1.7)
    assert math.isclose(cal.expected_tau(torch.ones(1, 15), torch.ones(1, 15)).item(), 16.0)
