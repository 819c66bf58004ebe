"""Per-data-plane block budget: reported free minus reservations."""

from __future__ import annotations

import pytest

from pagedserve.controlplane.routing.budget import BlockBudget


def test_reserve_release_and_report() -> None:
    b = BlockBudget()
    b.report(free_blocks=10, total_blocks=12)
    b.reserve("a", 4)
    b.reserve("b", 3)
    assert (b.reserved_blocks, b.available_blocks) == (7, 3)
    assert b.release("a") == 4
    assert b.release("a") == 0  # idempotent
    b.report(free_blocks=6, total_blocks=12)
    assert b.available_blocks == 3
    assert b.holds("b") and not b.holds("a")
    with pytest.raises(ValueError, match="already holds"):
        b.reserve("b", 1)
    b.clear()
    assert (b.reserved_blocks, b.available_blocks) == (0, 0)
