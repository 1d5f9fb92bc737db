"""Learning-rate schedules: length, warmup, and the shape of each decay."""
import numpy as np
import pytest

from src.lr_schedule import build_lr_schedule


def test_constant_is_the_reference_fixed_rate():
    rates = build_lr_schedule("constant", 0.001, epochs=3, steps_per_epoch=5)
    assert rates.shape == (15,) and rates.dtype == np.float32
    assert np.allclose(rates, 0.001)


def test_warmup_rises_linearly_to_the_base_rate():
    rates = build_lr_schedule("constant", 0.1, epochs=4, steps_per_epoch=10, warmup_epochs=2)
    assert np.allclose(rates[:20], 0.1 * np.arange(1, 21) / 20)
    assert np.allclose(rates[20:], 0.1)


def test_cosine_goes_from_base_to_min_monotonically():
    rates = build_lr_schedule("cosine", 0.1, epochs=10, steps_per_epoch=10, lr_min=0.001)
    assert rates[0] == pytest.approx(0.1)
    assert rates[-1] == pytest.approx(0.001, abs=1e-4)
    assert np.all(np.diff(rates) <= 1e-9)
    assert rates[50] == pytest.approx(0.001 + 0.099 * 0.5, rel=1e-5)  # halfway down


def test_step_decays_every_step_epochs_like_steplr():
    rates = build_lr_schedule("step", 1.0, epochs=7, steps_per_epoch=2, step_epochs=3, gamma=0.1)
    per_epoch = rates[::2]
    assert np.allclose(per_epoch, [1, 1, 1, 0.1, 0.1, 0.1, 0.01])


def test_poly_decays_with_the_given_power():
    rates = build_lr_schedule("poly", 1.0, epochs=1, steps_per_epoch=4, poly_power=2.0)
    assert np.allclose(rates, [1.0, 0.75 ** 2, 0.5 ** 2, 0.25 ** 2])


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        build_lr_schedule("linear", 0.1, 1, 1)


@pytest.mark.parametrize("total, pct_start", [(100, 0.3), (37, 0.25), (500, 0.1)])
def test_onecycle_matches_torch_one_cycle_lr(total, pct_start):
    torch = pytest.importorskip("torch")
    final = 0.1 / 25 / 1e4  # torch's default end: the start rate / final_div_factor
    ours = build_lr_schedule("onecycle", 0.1, epochs=1, steps_per_epoch=total, lr_min=final,
                             onecycle_pct_start=pct_start)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total, pct_start=pct_start,
                                                    anneal_strategy="cos", cycle_momentum=False)
    theirs = []
    for _ in range(total):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert np.abs(ours - np.array(theirs)).max() <= 1e-8
