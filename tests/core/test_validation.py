"""The typed YAML walker on its own: every error names the dotted key, what was expected and what was written."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from hfscale.core.validation import Invalid, build


@dataclass(frozen=True, kw_only=True)
class Inner:
    stage: Literal[0, 1, 2, 3] = 0
    rate: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.name == "bad":
            raise ValueError("name: 'bad' is refused")


def test_builds_nested_dataclasses_and_reads_yaml_floats():
    built = build(Outer, {"name": "x", "inner": {"stage": 2, "rate": "5e-5"}, "sizes": [1, 2]}, "")
    assert built == Outer(name="x", inner=Inner(stage=2, rate=5e-5), sizes=[1, 2])


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"name": "x", "inner": {"stag": 1}}, "inner.stag", r"unknown key \(did you mean 'stage'\?\); valid keys"),
        ({"name": "x", "inner": {"stage": 4}}, "inner.stage", "expected one of 0, 1, 2, 3, got 4"),
        ({"name": "x", "inner": {"stage": True}}, "inner.stage", "expected one of 0, 1, 2, 3, got true"),
        ({"name": "x", "sizes": [1, "two"]}, "sizes[1]", "expected an integer, got 'two'"),
        ({"inner": {}}, "", "missing required key"),
        ({"name": "bad"}, "", "name: 'bad' is refused"),
    ],
)
def test_errors_name_the_dotted_key(data, path, message):
    with pytest.raises(Invalid, match=message) as exc:
        build(Outer, data, "")
    assert exc.value.path == path
