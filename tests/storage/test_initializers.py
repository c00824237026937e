"""RowInitializer: per-key determinism, each kind's distribution, dtypes, and config errors.

n keys, D embedding dim.
"""

from __future__ import annotations

import math

import pytest
import torch

import dynemb
from dynemb.storage.initializers import RowInitializer

D = 8
CPU = torch.device("cpu")
# Keys spread over the int64 range, with the edge values a sentinel-based table would reserve.
EDGES = torch.tensor([0, -1, 1, 2**63 - 1, -(2**63), 2**32, -(2**32)])
KEYS = torch.cat([EDGES, torch.arange(4000) * 2_654_435_761 - 10**15])

PER_KEY_KINDS = [
    dynemb.Initializer(kind="uniform"),
    dynemb.Initializer(kind="uniform", low=-0.2, high=0.3),
    dynemb.Initializer(kind="normal"),
    dynemb.Initializer(kind="normal", mean=1.0, std=0.5),
    dynemb.Initializer(kind="truncated_normal"),
    dynemb.Initializer(kind="truncated_normal", mean=-0.5, std=0.1, a=-1.0, b=1.5),
]


def initial(config: dynemb.Initializer, keys: torch.Tensor, *, seed: int = 0, dim: int = D, dtype: torch.dtype = torch.float32, device=CPU) -> torch.Tensor:
    """Initial rows [n, dim] of keys [n] from a fresh initializer (cloned: the result may be a
    view of a buffer the next call overwrites)."""
    return RowInitializer(config, dim, seed, dtype, torch.device(device))(keys.to(device)).clone()


def table(**kw):
    kw.setdefault("optimizer", dynemb.optim.SGD(lr=0.5))
    return dynemb.DynamicEmbedding(D, kw.pop("capacity", 256), **kw)


@pytest.mark.parametrize("config", PER_KEY_KINDS, ids=str)
@pytest.mark.parametrize("dim", [D, 7, 1])
def test_row_of_a_key_is_independent_of_its_batch(config, dim):
    rows = initial(config, KEYS, seed=5, dim=dim)
    assert rows.shape == (KEYS.numel(), dim)
    init = RowInitializer(config, dim, 5, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(KEYS.numel(), generator=g)
    # One initializer serving batches of other order, size and duplicates, one after another.
    torch.testing.assert_close(init(KEYS[perm]).clone(), rows[perm], rtol=0, atol=0)
    sub = torch.randint(KEYS.numel(), (37,), generator=g)  # with repeats
    torch.testing.assert_close(init(KEYS[sub]).clone(), rows[sub], rtol=0, atol=0)
    torch.testing.assert_close(init(KEYS[:1]).clone(), rows[:1], rtol=0, atol=0)
    assert init(KEYS[:0]).shape == (0, dim)
    torch.testing.assert_close(init(KEYS[-3:]).clone(), rows[-3:], rtol=0, atol=0)


@pytest.mark.parametrize("config", PER_KEY_KINDS, ids=str)
def test_distinct_keys_and_seeds_give_distinct_rows(config):
    rows = initial(config, KEYS, seed=0)
    assert torch.unique(rows, dim=0).shape[0] == KEYS.numel()
    other = initial(config, KEYS, seed=1)
    assert not bool((other == rows).all(1).any())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", PER_KEY_KINDS, ids=str)
def test_row_of_a_key_is_the_same_on_cuda(config):
    # The bits are integer hashing, bitwise equal; log / sin / erfinv of CUDA may differ by ulps.
    torch.testing.assert_close(initial(config, KEYS, device="cuda").cpu(), initial(config, KEYS))


def normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


def cdf_of(config: dynemb.Initializer, dim: int):
    """The documented distribution's CDF (float64 in, float64 out)."""
    bound = 1 / math.sqrt(dim)
    std = bound if config.std is None else config.std
    if config.kind == "uniform":
        low = -bound if config.low is None else config.low
        high = bound if config.high is None else config.high
        return lambda x: ((x - low) / (high - low)).clamp(0, 1)
    if config.kind == "normal":
        return lambda x: normal_cdf((x - config.mean) / std)
    pa, pb = normal_cdf(torch.tensor(config.a, dtype=torch.float64)), normal_cdf(torch.tensor(config.b, dtype=torch.float64))
    return lambda x: ((normal_cdf((x - config.mean) / std) - pa) / (pb - pa)).clamp(0, 1)


def ks_distance(sample: torch.Tensor, cdf) -> float:
    """Kolmogorov-Smirnov distance between a 1-D sample and a CDF."""
    x, _ = sample.double().sort()
    n = x.numel()
    f = cdf(x)
    up = torch.arange(1, n + 1, dtype=torch.float64) / n - f
    down = f - torch.arange(n, dtype=torch.float64) / n
    return float(torch.maximum(up, down).max())


DISTRIBUTIONS = PER_KEY_KINDS + [
    dynemb.Initializer(kind="uniform", per_key=False),
    dynemb.Initializer(kind="normal", mean=2.0, std=3.0, per_key=False),
    dynemb.Initializer(kind="truncated_normal", a=-0.5, b=3.0, per_key=False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("config", DISTRIBUTIONS, ids=str)
def test_each_kind_has_its_documented_distribution(config, dtype):
    n = 50_000
    keys = torch.arange(n) * 2_654_435_761 + 12345  # regular keys: a weak mixer would show
    values = initial(config, keys, seed=11, dtype=dtype).double()  # [n, D]
    # Each column is n draws, independent across keys. DKW: P(KS distance > t) <= 2 exp(-2 n t^2);
    # t (0.0146) puts that at 1e-9 per column; a std 10% off, or a uniform in place of a normal
    # of the same variance, measured 0.025 or more away at this n (the right one: 0.004-0.007).
    # Cut points are checked exactly below.
    t = math.sqrt(math.log(2e9) / (2 * n))
    cdf = cdf_of(config, D)
    distances = [ks_distance(values[:, j], cdf) for j in range(D)]
    assert max(distances) < t, f"KS distances {distances}, bound {t:.4f}"
    # Columns uncorrelated: a sample correlation of independent columns has std 1/sqrt(n) = 0.0045;
    # 0.03 is over 6 of those, and columns sharing bits would correlate far more.
    corr = torch.corrcoef(values.T) - torch.eye(D, dtype=torch.float64)
    assert float(corr.abs().max()) < 0.03
    if config.kind == "truncated_normal":
        std = 1 / math.sqrt(D) if config.std is None else config.std
        # The cut points computed in the rows' dtype as the initializer does (rounding is monotone).
        lo, hi = (torch.tensor([config.a, config.b], dtype=dtype) * std + config.mean).tolist()
        assert lo <= float(values.min()) and float(values.max()) <= hi
    if config.kind == "uniform":
        bound = 1 / math.sqrt(D)
        low = -bound if config.low is None else config.low
        high = bound if config.high is None else config.high
        assert low <= float(values.min()) and float(values.max()) < high


@pytest.mark.parametrize("per_key", [True, False])
def test_constant(per_key):
    config = dynemb.Initializer(kind="constant", value=-0.75, per_key=per_key)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        rows = initial(config, KEYS, dtype=dtype)
        assert rows.dtype == dtype
        torch.testing.assert_close(rows, torch.full((KEYS.numel(), D), -0.75, dtype=dtype), rtol=0, atol=0)


def test_generator_draws_follow_the_seed():
    # per_key=False draws from a generator seeded with the table seed: same seed and calls, same
    # values; another seed, other values.
    config = dynemb.Initializer(kind="normal", per_key=False)
    a, b, c = (RowInitializer(config, D, s, torch.float32, CPU) for s in (3, 3, 4))
    for n in (5, 17, 1):
        ra, rb, rc = (i(KEYS[:n]).clone() for i in (a, b, c))
        torch.testing.assert_close(ra, rb, rtol=0, atol=0)
        assert not bool((ra == rc).all(1).any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", PER_KEY_KINDS, ids=str)
def test_16_bit_rows_are_the_float32_rows_rounded(config, dtype):
    # 16-bit tables sample in float32 and round once, so a key's row is the same value in every
    # dtype up to that rounding.
    rows = initial(config, KEYS, dtype=dtype)
    assert rows.dtype == dtype
    torch.testing.assert_close(rows, initial(config, KEYS).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("config", PER_KEY_KINDS, ids=str)
def test_float64_rows_agree_with_float32_rows(config):
    # float64 rows use the same bits with 53 of them kept, float32 rows 24: they differ by float32
    # rounding (the default tolerance), except normal radii sqrt(-2 log u) for u near 1, where a
    # rounding of u by at most 2^-25 moves sqrt(2 (1 - u)) by at most sqrt(2 * 2^-25) = 2^-12.
    rows = initial(config, KEYS, dtype=torch.float64)
    assert rows.dtype == torch.float64
    std = 1 / math.sqrt(D) if config.std is None else config.std
    tol = {"atol": 2**-12 * std, "rtol": 1.3e-6} if config.kind == "normal" else {}
    torch.testing.assert_close(rows.float(), initial(config, KEYS), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_table_rows_follow_the_table_dtype(dtype):
    config = dynemb.Initializer(kind="normal", std=0.3)
    t = table(initializer=config, seed=9, dtype=dtype)
    with torch.no_grad():
        out = t(KEYS[:50])
    values, found = t.find(KEYS[:50])
    assert out.dtype == values.dtype == dtype and bool(found.all())
    expected = initial(config, KEYS[:50], seed=9, dtype=dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(values, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "init,check",
    [
        (dynemb.Initializer(kind="uniform", low=-0.2, high=0.3), lambda v: v.min() >= -0.2 and v.max() < 0.3 and abs(v.mean() - 0.05) < 0.01),
        (dynemb.Initializer(kind="normal", mean=1.0, std=0.5), lambda v: abs(v.mean() - 1.0) < 0.01 and abs(v.std() - 0.5) < 0.01),
        (dynemb.Initializer(kind="truncated_normal", std=0.1, a=-1.0, b=1.5), lambda v: v.min() >= -0.1 and v.max() <= 0.15 and v.std() < 0.1),
        (dynemb.Initializer(kind="constant", value=0.5), lambda v: bool((v == 0.5).all())),
        (dynemb.Initializer(kind="normal", per_key=False), lambda v: abs(v.std() - 1 / math.sqrt(D)) < 0.01),
    ],
)
def test_initializers(init, check):
    t = table(capacity=1 << 15, initializer=init)
    with torch.no_grad():
        values = t(torch.arange(20000) * 7919 - 10**12)
    assert check(values)


@pytest.mark.parametrize(
    "init,match",
    [
        (dict(kind="normal", std=float("inf")), "initializer.std=inf"),
        (dict(low=float("-inf")), "initializer.low=-inf"),
    ],
)
def test_initializer_rejects_non_finite(init, match):
    with pytest.raises(ValueError, match=match):
        dynemb.Initializer(**init)


@pytest.mark.parametrize(
    "init,match",
    [
        (dict(kind="bogus"), "initializer.kind='bogus'"),
        (dict(std=0.0), "initializer.std=0.0: must be > 0"),
        (dict(low=0.5, high=0.5), "initializer.low=0.5: must be < high=0.5"),
        (dict(a=1.0, b=1.0), "initializer.a=1.0: must be < b=1.0"),
        (dict(high=float("nan")), "initializer.high=nan"),
        (dict(mean=float("nan")), "initializer.mean=nan"),
        (dict(value=float("inf")), "initializer.value=inf"),
    ],
)
def test_initializer_rejects_bad_fields(init, match):
    with pytest.raises(ValueError, match=match):
        dynemb.Initializer(**init)


def test_initializer_rejects_one_bound_past_the_default_other():
    with pytest.raises(ValueError, match="initializer.low=5.0"):
        dynemb.DynamicEmbedding(D, 64, initializer=dynemb.Initializer(low=5.0))


def test_row_initializer_names_both_bounds():
    # D = 4: the unset low is -1/sqrt(4) = -0.5, above the given high.
    with pytest.raises(ValueError, match=r"initializer.low=-0.5, high=-1.0: need low < high \(an unset bound is -/\+ 1/sqrt\(D\) = 0.5\)"):
        RowInitializer(dynemb.Initializer(high=-1.0), 4, 0, torch.float32, CPU)
