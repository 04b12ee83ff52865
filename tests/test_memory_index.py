"""The protected set's memory index: built in one sweep, the same groups as one range at a time."""

from __future__ import annotations

import random
from typing import Any

from kvguard._protect.index import _Groups


class _Entry:
    def __init__(self, order: int) -> None:
        self.order = order


def _random_spans(rng: random.Random) -> list[tuple[int, int, int, Any]]:
    spans = []
    for order in range(rng.randint(0, 30)):
        entry = _Entry(order)
        for _ in range(rng.choice((1, 1, 1, 2))):  # some entries have two spans (sparse, wrappers)
            start = rng.randint(0, 200)
            spans.append((start, start + rng.randint(1, 30), order, entry))
    return spans


def test_the_sweep_makes_the_groups_adding_one_by_one_makes() -> None:
    rng = random.Random(16)
    for _ in range(3000):
        spans = _random_spans(rng)
        one_by_one = _Groups()
        for start, stop, _, entry in spans:
            one_by_one.add(start, stop, entry)
        swept = _Groups.of(list(spans))
        assert (swept.starts, swept.stops) == (one_by_one.starts, one_by_one.stops)
        assert [{id(e) for e in m} for m in swept.members] == [{id(e) for e in m} for m in one_by_one.members]
        for members in swept.members:  # each entry once, in the set's order
            assert [e.order for e in members] == sorted({e.order for e in members})


def test_touching_ranges_stay_apart_and_a_byte_in_common_joins_them() -> None:
    a, b, c = _Entry(0), _Entry(1), _Entry(2)
    groups = _Groups.of([(10, 20, 0, a), (20, 30, 1, b), (29, 40, 2, c)])
    assert (groups.starts, groups.stops) == ([10, 20], [20, 40])
    assert [[e.order for e in m] for m in groups.members] == [[0], [1, 2]]
    assert [[e.order for e in m] for m in groups.meeting(19, 21)] == [[0], [1, 2]]
    assert not groups.meets(40, 50)
