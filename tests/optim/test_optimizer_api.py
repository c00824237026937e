"""The torch.optim.Optimizer face of the fused optimizers: hyper-parameters in param_groups[0],
validation, no-op step / zero_grad, state_dict round trips."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from dynemb.optim import SGD, Adagrad, Adam, RowOptimizer, RowWiseAdagrad

OPTIMIZERS = [SGD, Adagrad, RowWiseAdagrad, Adam]
# Non-default values of every hyper-parameter, per class.
CUSTOM = {
    SGD: {"lr": 0.3, "weight_decay": 0.01},
    Adagrad: {"lr": 0.3, "lr_decay": 0.1, "weight_decay": 0.01, "initial_accumulator_value": 0.2, "eps": 1e-6},
    RowWiseAdagrad: {"lr": 0.3, "eps": 1e-6, "weight_decay": 0.01, "initial_accumulator_value": 0.2},
    Adam: {"lr": 0.3, "betas": (0.5, 0.75), "eps": 1e-6, "weight_decay": 0.01},
}
BAD_NUMBERS = [-1, -0.5, float("nan"), float("inf"), "0.1", True, None, torch.tensor(0.1)]
BAD_BETAS = [(1.5, 0.9), (0.9, 1.0), (-0.1, 0.9), (0.9,), (0.9, 0.9, 0.9), "ab", (True, 0.9), (float("nan"), 0.9), 0.9]
BAD = [(cls, name, value) for cls in OPTIMIZERS for name in CUSTOM[cls] if name != "betas" for value in BAD_NUMBERS]
BAD += [(Adam, "betas", value) for value in BAD_BETAS]


def message(cls: type, name: str, value) -> str:
    return re.escape(f"{cls.__name__}.{name}={value!r}: must be")


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_is_a_torch_optimizer_with_one_empty_group(cls):
    opt = cls(**CUSTOM[cls])
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, RowOptimizer)
    assert len(opt.param_groups) == 1
    assert opt.param_groups[0] == {"params": [], **CUSTOM[cls]}
    assert all(opt.defaults[k] == v for k, v in CUSTOM[cls].items())


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_attributes_are_the_param_group(cls):
    opt = cls()
    group = opt.param_groups[0]
    for name, value in CUSTOM[cls].items():
        setattr(opt, name, value)
        assert group[name] == value
        group[name] = value / 2 if name != "betas" else (0.25, 0.5)
        assert getattr(opt, name) == group[name]


def test_values_are_stored_as_floats():
    opt = Adam(lr=1, betas=[0, 0.5], eps=0)
    assert opt.param_groups[0] == {"params": [], "lr": 1.0, "betas": (0.0, 0.5), "eps": 0.0, "weight_decay": 0.0}
    assert type(opt.lr) is float and type(opt.betas[0]) is float


@pytest.mark.parametrize(("cls", "name", "value"), BAD)
def test_bad_hyper_parameter_names_field_and_value(cls, name, value):
    with pytest.raises(ValueError, match=message(cls, name, value)):
        cls(**{name: value})
    opt = cls(**CUSTOM[cls])
    with pytest.raises(ValueError, match=message(cls, name, value)):
        setattr(opt, name, value)
    assert opt.param_groups[0][name] == CUSTOM[cls][name]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bad_value_written_to_the_group_fails_at_the_next_update(cls):
    """Schedulers write param_groups[0] directly; the update validates what it reads."""
    opt = cls()
    opt.param_groups[0]["lr"] = -0.1
    S = opt.state_dim(2)
    with pytest.raises(ValueError, match=message(cls, "lr", -0.1)):
        opt.update(torch.zeros(3, 2), torch.zeros(3, S), torch.ones(3, 2), 1)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}.lr=tensor(0.1000): must be")):
        _ = opt.lr


def test_adam_bad_betas_in_the_group_fail_at_the_next_update():
    opt = Adam()
    opt.param_groups[0]["betas"] = (1.0, 0.9)
    with pytest.raises(ValueError, match=message(Adam, "betas", (1.0, 0.9))):
        opt.update(torch.zeros(3, 2), torch.zeros(3, 4), torch.ones(3, 2), 1)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_step_and_zero_grad_are_no_ops(cls):
    opt = cls(**CUSTOM[cls])
    before = copy.deepcopy(opt.param_groups)
    assert opt.step() is None
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert opt.param_groups == before


def test_step_runs_the_closure_with_grad_enabled():
    opt = SGD()
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        return 1.5

    with torch.no_grad():
        assert opt.step(closure) == 1.5
    assert seen == [True]


def test_step_hooks_fire():
    opt = SGD()
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    opt.step()
    assert calls == [("pre", opt), ("post", opt)]


def test_add_param_group_is_refused():
    with pytest.raises(TypeError, match="SGD holds no parameters"):
        SGD().add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_state_dict_round_trip_through_torch_save(cls):
    opt = cls(**CUSTOM[cls])
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = cls()
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    assert loaded.param_groups == opt.param_groups
    assert loaded.param_groups[0]["initial_lr"] == CUSTOM[cls]["lr"]
    assert repr(loaded) == repr(opt)
    assert loaded.state_dict() == opt.state_dict() == {"state": {}, "param_groups": opt.param_groups}


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_load_state_dict_validates_before_changing_anything(cls):
    opt = cls(**CUSTOM[cls])
    before = copy.deepcopy(opt.param_groups)
    bad = cls().state_dict()
    bad["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(ValueError, match=message(cls, "lr", float("nan"))):
        opt.load_state_dict(bad)
    missing = cls().state_dict()
    del missing["param_groups"][0]["weight_decay"]
    with pytest.raises(ValueError, match=f"{cls.__name__}.load_state_dict: param_groups\\[0\\] has no 'weight_decay'"):
        opt.load_state_dict(missing)
    with pytest.raises(ValueError, match="one parameter group with no params"):
        opt.load_state_dict(torch.optim.SGD([torch.zeros(1, requires_grad=True)]).state_dict())
    assert opt.param_groups == before


def test_load_state_dict_hooks_fire():
    opt = SGD()
    calls = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.lr)))
    opt.load_state_dict(SGD(lr=0.7).state_dict())
    assert calls == ["pre", ("post", 0.7)]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_repr_lists_hyper_parameters(cls):
    opt = cls(**CUSTOM[cls])
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    fields = ", ".join(f"{k}={v!r}" for k, v in CUSTOM[cls].items())
    assert repr(opt) == f"{cls.__name__}({fields})"


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_deepcopy_is_independent(cls):
    opt = cls(**CUSTOM[cls])
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    clone = copy.deepcopy(opt)
    assert repr(clone) == repr(opt)
    clone.lr = 0.01
    assert opt.lr == CUSTOM[cls]["lr"]
    assert clone.lr == 0.01
