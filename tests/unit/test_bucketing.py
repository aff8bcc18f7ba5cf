"""ddp.bucketing.plan_buckets as the pure function it is: specs in, plan out (no MPI)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp.bucketing import ParamSpec, plan_buckets


def f32(numel, device="cpu"):
    return ParamSpec(numel, 4, "float32", device)


def members(plans):
    return [list(plan.params) for plan in plans]


def test_reverse_registration_order_and_caps():
    specs = [f32(10), f32(10), f32(10), f32(10), f32(10)]  # 40 bytes each
    plans = plan_buckets(specs, cap_bytes=100, first_cap_bytes=40)
    # first bucket closes at 40 bytes (one param), later ones at >= 100 bytes (three params)
    assert members(plans) == [[4], [3, 2, 1], [0]]
    assert [plan.offsets for plan in plans] == [(0,), (0, 10, 20), (0,)]
    assert [plan.numel for plan in plans] == [10, 30, 10]


def test_cap_below_every_param_gives_one_bucket_per_param():
    specs = [f32(3), f32(7), f32(1)]
    plans = plan_buckets(specs, cap_bytes=1, first_cap_bytes=1)
    assert members(plans) == [[2], [1], [0]]


def test_huge_cap_gives_one_bucket():
    plans = plan_buckets([f32(3), f32(7), f32(1)], cap_bytes=1 << 30, first_cap_bytes=1 << 30)
    assert members(plans) == [[2, 1, 0]]
    assert plans[0].offsets == (0, 1, 8)


def test_one_dtype_and_device_per_bucket():
    specs = [f32(4), ParamSpec(4, 2, "float16"), f32(4), ParamSpec(4, 2, "float16"), f32(4, "cuda:0")]
    plans = plan_buckets(specs, cap_bytes=1 << 20)
    assert {(plan.dtype, plan.device) for plan in plans} == {("float32", "cpu"), ("float16", "cpu"),
                                                            ("float32", "cuda:0")}
    for plan in plans:
        assert len({(specs[i].dtype, specs[i].device) for i in plan.params}) == 1
    # numbered by where their first parameter comes in the walk (reverse order: 4, 3, 2, ...)
    assert members(plans) == [[4], [3, 1], [2, 0]]


def test_given_order_is_followed():
    specs = [f32(10)] * 4
    plans = plan_buckets(specs, cap_bytes=80, first_cap_bytes=40, order=[1, 3, 0, 2])
    assert members(plans) == [[1], [3, 0], [2]]


@pytest.mark.parametrize("order", [[0, 1], [0, 0, 1, 2], [0, 1, 3]])
def test_bad_order_rejected(order):
    with pytest.raises(ValueError, match="exactly once"):
        plan_buckets([f32(1)] * 3, cap_bytes=10, order=order)


@pytest.mark.parametrize("cap", [0, -1])
def test_bad_cap_rejected(cap):
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets([f32(1)], cap_bytes=cap)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 400), st.integers(1, 400),
       st.randoms(use_true_random=False))
def test_plan_invariants(sizes, cap, first_cap, rng):
    specs = [f32(n) for n in sizes]
    order = list(range(len(specs)))
    rng.shuffle(order)
    plans = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first_cap, order=order)
    flat = [i for plan in plans for i in plan.params]
    assert sorted(flat) == list(range(len(specs)))          # every parameter exactly once
    assert flat == order                                     # one dtype: the walk order is kept
    for k, plan in enumerate(plans):
        limit = first_cap if k == 0 else cap
        nbytes = sum(specs[i].nbytes for i in plan.params)
        # closed as soon as it reaches its cap: without its last parameter it was under the cap
        assert nbytes - specs[plan.params[-1]].nbytes < limit
        if k < len(plans) - 1:
            assert nbytes >= limit
        assert plan.offsets == tuple(sum(specs[j].numel for j in plan.params[:m]) for m in range(len(plan.params)))
