"""Golden runs: a refactor that should not change training numerics cannot, on any x86-64 CPU.

Bitwise only within one process; against the committed runs within ``RTOL``, which kernel
reordering (another SIMD level, another thread count) cannot reach and a changed update rule
does (both shown here).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from golden_model import CASES, GOLDEN, RTOL, deviation, read_golden, run

from dynemb.optim import optimizers


def _run(case: str) -> dict:
    name, kind = case.split("-")
    return run(name, kind == "pooled")


@pytest.mark.parametrize("case", CASES)
def test_run_matches_golden(case):
    got, want = _run(case), read_golden()[case]
    assert deviation(got, want) <= RTOL, f"{case}: {got} vs golden {want}"


@pytest.mark.parametrize("case", ["sgd-sequence", "adam-pooled"])
def test_two_runs_in_one_process_are_bitwise_equal(case):
    a, b = _run(case), _run(case)
    assert [v.hex() for v in a["losses"]] == [v.hex() for v in b["losses"]]
    assert a["trained_l1"].hex() == b["trained_l1"].hex()


def test_other_kernels_and_one_thread_stay_within_tolerance(tmp_path):
    """The same runs with ATen's portable kernels (no SIMD) on one thread: other sums, other
    last bits, but inside RTOL."""
    script = (
        "import json, sys, torch; torch.set_num_threads(1); "
        f"sys.path.insert(0, {str(GOLDEN.parent)!r}); import golden_model as g; "
        "print(json.dumps(g.all_runs()))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    raw = json.loads(out.stdout)
    golden = read_golden()
    for case in CASES:
        got = {"losses": [float.fromhex(v) for v in raw[case]["losses"]], "trained_l1": float.fromhex(raw[case]["trained_l1"])}
        assert deviation(got, golden[case]) <= RTOL, case


def _sgd_step_larger(self, weight, state, grad, step):
    weight.add_(grad, alpha=-self.lr * 1.001)


def _adagrad_eps_inside_sqrt(self, weight, state, grad, step):
    state.addcmul_(grad, grad)
    weight.addcdiv_(grad, state.add(self.eps).sqrt_(), value=-self.lr)


def _rowwise_sum_not_mean(self, weight, state, grad, step):
    state.add_(grad.square().sum(1, keepdim=True))
    weight.addcdiv_(grad, state.sqrt().add_(self.eps), value=-self.lr)


def _adam_no_bias_correction(self, weight, state, grad, step):
    beta1, beta2 = self.betas
    D = weight.shape[1]
    exp_avg, exp_avg_sq = state[:, :D], state[:, D:]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.add_(grad.square().sub_(exp_avg_sq).mul_(1 - beta2))
    weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(self.eps), value=-self.lr)


CHANGED_RULES = {
    "sgd: step 0.1% larger": ("sgd", optimizers.SGD, _sgd_step_larger),
    "adagrad: eps inside the sqrt": ("adagrad", optimizers.Adagrad, _adagrad_eps_inside_sqrt),
    "rowwise_adagrad: sum, not mean": ("rowwise_adagrad", optimizers.RowWiseAdagrad, _rowwise_sum_not_mean),
    "adam: no bias correction": ("adam", optimizers.Adam, _adam_no_bias_correction),
}


@pytest.mark.parametrize("rule", list(CHANGED_RULES))
@pytest.mark.parametrize("kind", ["sequence", "pooled"])
def test_a_changed_update_rule_fails_the_check(rule, kind, monkeypatch):
    name, cls, update = CHANGED_RULES[rule]
    monkeypatch.setattr(cls, "update", update)
    got = _run(f"{name}-{kind}")
    # Caught with a margin: the smallest change (0.1% of the SGD step) moves the run 100x RTOL.
    assert deviation(got, read_golden()[f"{name}-{kind}"]) > 10 * RTOL
    assert all(math.isfinite(v) for v in got["losses"])
