"""The victim rule of kv_store/slot_maps.py (the fused planning kernel must match it: the
parity check in test_kv_store_hierarchical.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.kv_store.slot_maps import SlotMaps

UB = 8  # buffer units of 4 tokens; sequence of 40 tokens: units 0 (sink) and >= 9 (recent, newest) pinned


def maps_with(owners: list[int], ages: list[int]) -> SlotMaps:
    m = SlotMaps(num_layers=1, max_requests=1, streams=1, max_units=16, buffer_units=UB, unit=4,
                 sink_tokens=4, recent_tokens=4, device=torch.device("cpu"))
    m.s2l[0, 0, 0, :UB] = torch.tensor(owners, dtype=torch.int32)
    m.last_used[0, 0, 0, :UB] = torch.tensor(ages)
    return m


def victims(m: SlotMaps, count: int, need: int | None, protect: list[int] = ()) -> list[int]:
    p = torch.zeros(1, 1, UB, dtype=torch.bool)
    p[0, 0, list(protect)] = True
    n = None if need is None else torch.tensor([[need]])
    return m.victims(0, torch.tensor([0]), torch.tensor([40]), p, count, need=n)[0, 0].tolist()


def test_victims_are_the_oldest_unpinned_units_in_unit_order() -> None:
    # buffer unit: 0    1    2    3    4    5    6    7
    owners = [0, 9, 1, 2, 3, 4, 5, 6]  # units 0 and 9 pinned
    ages = [0, 0, 5, 3, 1, 3, 0, 7]
    m = maps_with(owners, ages)
    assert victims(m, 5, None) == [6, 4, 3, 5, 2]  # eviction order: by age, ties to the lower unit
    assert victims(m, 5, 3) == [3, 4, 6, UB, UB]  # the 3 oldest (age 0, 1, the lower of the 3s), ascending
    assert victims(m, 5, 3, protect=[6]) == [3, 4, 5, UB, UB]
    m.s2l[0, 0, 0, 7] = -1  # a free unit goes first, whatever its stamp
    assert victims(m, 5, 2) == [6, 7, UB, UB, UB]
    assert victims(m, 8, 8) == [2, 3, 4, 5, 6, 7, UB, UB]  # never a pinned unit, even when more are needed


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-1, 15), min_size=UB, max_size=UB), st.lists(st.integers(0, 2**40), min_size=UB, max_size=UB),
       st.integers(0, UB))
def test_victims_with_need_are_the_need_first_of_the_eviction_order_sorted(owners: list[int], ages: list[int], need: int) -> None:
    m = maps_with(owners, ages)
    order = victims(m, UB, None)
    eligible = sum(1 for o in owners if 0 < o < 9 or o < 0)
    chosen = victims(m, UB, need)
    n = min(need, eligible)
    assert chosen == sorted(order[:n]) + [UB] * (UB - n)


def test_a_buffer_smaller_than_sink_and_recent_window_is_refused_with_its_size() -> None:
    maps = SlotMaps(num_layers=1, max_requests=1, streams=1, max_units=64, buffer_units=2, unit=4,
                    sink_tokens=8, recent_tokens=8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"exceed device_buffer_tokens \(8 tokens\)"):
        maps.initial_units(64)
