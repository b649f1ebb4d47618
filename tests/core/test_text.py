from __future__ import annotations

import pytest

from hfscale.core.text import clock, listed


def test_listed_names_items_as_a_sentence_does() -> None:
    assert listed(["a"]) == "a"
    assert listed(["a", "b"]) == "a and b"
    assert listed(["a", "b", "c"]) == "a, b and c"


def test_listed_refuses_nothing_to_name() -> None:
    with pytest.raises(ValueError, match="at least one item"):
        listed([])


def test_clock_rounds_down_to_whole_seconds() -> None:
    assert clock(3723.9) == "1:02:03"
    assert clock(59.99) == "0:00:59"
