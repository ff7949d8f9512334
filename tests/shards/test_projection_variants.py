"""Projection variants (shards.projection): the rank a variance target picks is the smallest that
reaches it in every tap; a projection that keeps the largest channels exactly reconstructs them
exactly, is orthonormal, and records the share it keeps; specs round-trip and bad ones are refused."""

from __future__ import annotations

import pytest
import torch

from shards.projection import (
    SecondMoments,
    captured_shares,
    fit_projection,
    parse_projection_spec,
    smallest_rank_keeping,
)


def moments_with_spectrum(spectra: list[list[float]], seed: int = 0) -> SecondMoments:
    """Second moments whose eigenvalues per tap are exactly `spectra` (in random orthogonal bases)."""
    generator = torch.Generator().manual_seed(seed)
    H = len(spectra[0])
    moments = SecondMoments(len(spectra), H)
    sums = []
    for values in spectra:
        q, _ = torch.linalg.qr(torch.randn(H, H, generator=generator, dtype=torch.float64))
        sums.append(q @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ q.t())
    moments.sums, moments.tokens = torch.stack(sums), 100
    return moments


def test_variance_target_picks_the_smallest_rank_reaching_it_in_every_tap():
    # shares: tap 0 0.5 0.8 0.9 0.95 0.98 1.0; tap 1 0.7 0.9 0.96 0.99 1.0 1.0
    moments = moments_with_spectrum([[50, 30, 10, 5, 3, 2], [70, 20, 6, 3, 1, 0]])
    ranks = {
        v: fit_projection(moments, parse_projection_spec(f"pca:variance={v}")).rank
        for v in (0.5, 0.8, 0.9, 0.91, 0.97, 1.0)
    }
    assert ranks == {0.5: 1, 0.8: 2, 0.9: 3, 0.91: 4, 0.97: 5, 1.0: 6}
    projection = fit_projection(moments, parse_projection_spec("pca:variance=0.9"))
    assert projection.info["explained"] == pytest.approx([0.9, 0.96])
    assert fit_projection(moments, parse_projection_spec("pca:variance=0.9"), multiple=4).rank == 4
    shares = torch.tensor([0.5, 0.8, 0.9, 0.95])
    assert [smallest_rank_keeping(shares, t) for t in (0.4, 0.8, 0.85, 0.95, 0.99)] == [1, 2, 3, 4, 4]


def features_with_massive_channels(n: int = 600, H: int = 32, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(H, H, generator=generator) / H**0.5
    h = torch.randn(n, H, generator=generator) @ mix
    h[:, 5] += 40.0 * (torch.rand(n, generator=generator) < 0.1)  # a massive channel on a few tokens
    h[:, 17] -= 15.0
    return h


def test_kept_channels_are_reconstructed_exactly_and_the_rest_is_a_pca():
    h = features_with_massive_channels()
    moments = SecondMoments(1, h.shape[1])
    moments.add(h)
    kept = fit_projection(moments, parse_projection_spec("pca:rank=6,keep=2"))
    plain = fit_projection(moments, parse_projection_spec("pca:rank=6"))
    rows = kept.blocks[0]
    torch.testing.assert_close(rows @ rows.t(), torch.eye(6), atol=1e-5, rtol=0)  # orthonormal
    assert sorted(rows[:2].abs().argmax(-1).tolist()) == [5, 17]  # the two largest-energy channels
    back = kept.back(kept.apply(h))
    torch.testing.assert_close(back[:, [5, 17]], h[:, [5, 17]], atol=1e-5, rtol=0)  # exact (up to fp32)
    assert not torch.allclose(back, h, atol=1e-2)  # the other channels are projected
    # PCA is the best rank-6 projection of the calibration data; keeping channels costs at most that much more.
    err_kept = ((back - h) ** 2).sum() / (h**2).sum()
    err_plain = ((plain.back(plain.apply(h)) - h) ** 2).sum() / (h**2).sum()
    assert err_plain <= err_kept + 1e-6
    assert kept.info["explained"][0] == pytest.approx(1 - float(err_kept), abs=1e-4)
    assert kept.info["method"] == "pca-uncentered-per-tap-kept-channels" and kept.info["spec"] == "pca:rank=6,keep=2"
    assert captured_shares(rows.double(), moments.sums[0])[-1] == pytest.approx(kept.info["explained"][0])


def test_specs_round_trip_and_bad_ones_are_refused():
    for text in ("pca:rank=8", "pca:rank=8,keep=2", "pca:variance=0.99", "pca:variance=0.999,keep=4"):
        assert parse_projection_spec(text).describe() == text
    with pytest.raises(ValueError, match="fewer than the rank"):
        parse_projection_spec("pca:rank=4,keep=4")
    with pytest.raises(ValueError, match="keep=K"):
        parse_projection_spec("pca:rank=4,keep=-1")
