"""torch.optim.lr_scheduler drives the fused optimizers exactly as it drives torch.optim.SGD."""

from __future__ import annotations

import io

import pytest
import torch
from torch.optim import lr_scheduler

from dynemb.optim import SGD, Adagrad, Adam, RowWiseAdagrad

# Any scheduler warning (step order, overridden step) is a failure.
pytestmark = pytest.mark.filterwarnings("error")

STEPS = 10
OPTIMIZERS = [SGD, Adagrad, RowWiseAdagrad, Adam]
SCHEDULERS = {
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)),
    "cosine": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3),
    "one_cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=STEPS + 1, cycle_momentum=False),
    "plateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1),
}
# ReduceLROnPlateau's metric: improves, then stalls so the lr drops twice.
METRICS = [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 2.0, 2.0]


def lr_sequence(opt: torch.optim.Optimizer, schedule: str) -> list[float]:
    """lr seen by each of STEPS steps of the loop backward; opt.step(); sched.step()."""
    sched = SCHEDULERS[schedule](opt)
    lrs = []
    for step in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if schedule == "plateau":
            sched.step(METRICS[step])
        else:
            sched.step()
    return lrs


@pytest.mark.parametrize("schedule", list(SCHEDULERS))
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_scheduler_sets_lr_as_for_torch_sgd(cls, schedule):
    opt = cls(lr=0.1)
    ref = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    got = lr_sequence(opt, schedule)
    # The same scheduler code on the same Python floats: equal exactly, not only close.
    assert got == lr_sequence(ref, schedule)
    assert opt.lr == ref.param_groups[0]["lr"]
    assert len(set(got)) > 1


def test_one_cycle_momentum_cycles_adam_beta1():
    opt = Adam(lr=0.1, betas=(0.9, 0.99))
    ref = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1, betas=(0.9, 0.99))
    got, want = [], []
    for o, out in ((opt, got), (ref, want)):
        sched = lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=STEPS + 1)
        for _ in range(STEPS):
            o.step()
            sched.step()
            out.append((o.param_groups[0]["lr"], o.param_groups[0]["betas"]))
    assert got == want
    assert opt.betas == want[-1][1]


def test_scheduler_warns_when_optimizer_step_is_skipped():
    """opt.step() is a no-op, but the scheduler checks it is called: the wrapper is in place."""
    opt = SGD(lr=0.1)
    sched = lr_scheduler.StepLR(opt, step_size=1)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()


def test_update_uses_scheduled_lr():
    """SGD.update after each scheduler step moves rows as torch.optim.SGD under the same schedule."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=gen)
    param = weight.clone().requires_grad_()
    opt, ref = SGD(lr=0.2), torch.optim.SGD([param], lr=0.2)
    scheds = [lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (opt, ref)]
    empty = weight.new_empty(6, 0)
    for step in range(1, STEPS + 1):
        grad = torch.randn(6, 4, generator=gen)
        opt.update(weight, empty, grad, step)
        param.grad = grad.clone()
        for o, s in zip((opt, ref), scheds):
            o.step()
            s.step()
    torch.testing.assert_close(weight, param.detach())


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_resume_optimizer_and_scheduler(cls):
    """Save both after 4 steps, load into fresh ones (torch's documented order), continue: the
    same lrs as an uninterrupted run."""
    opt = cls(lr=0.1)
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    lrs = []
    for _ in range(STEPS):
        opt.step()
        sched.step()
        lrs.append(opt.lr)
        if len(lrs) == 4:
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    opt2 = cls(lr=0.5)
    sched2 = lr_scheduler.CosineAnnealingLR(opt2, T_max=STEPS)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    resumed = []
    for _ in range(STEPS - 4):
        opt2.step()
        sched2.step()
        resumed.append(opt2.lr)
    assert resumed == lrs[4:]
