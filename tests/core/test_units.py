"""hfscale.core.units: shares and noise floors as users write them."""

from __future__ import annotations

import pytest

from hfscale.core.units import noise_floor_spec, parse_share


def test_a_share_is_read_as_a_fraction_or_a_percentage() -> None:
    assert parse_share("0.15") == 0.15 and parse_share("15%") == pytest.approx(0.15) and parse_share(" 7.5 % ") == 0.075
    assert parse_share("runs/grid") is None and parse_share("-3%") is None


def test_a_noise_floor_is_a_figure_or_a_run_folder_and_anything_else_is_named(tmp_path) -> None:
    assert noise_floor_spec("15%", tmp_path) == "0.15" and noise_floor_spec(0.2, tmp_path) == "0.2"
    (tmp_path / "grid").mkdir()
    (tmp_path / "grid" / "results.jsonl").write_text("")
    assert noise_floor_spec("grid", tmp_path) == str((tmp_path / "grid").resolve())  # relative to the base
    with pytest.raises(ValueError, match=r"between 0 and 1 \(0.15 or 15%\), got '150%'"):
        noise_floor_spec("150%", tmp_path)
    with pytest.raises(ValueError, match=r"or the run folder of an earlier sweep .* got 'nowhere'"):
        noise_floor_spec("nowhere", tmp_path)


def test_text_that_is_both_a_figure_and_a_run_folder_is_refused_with_both_readings(tmp_path) -> None:
    (tmp_path / "0.2").mkdir()
    (tmp_path / "0.2" / "results.jsonl").write_text("")
    with pytest.raises(
        ValueError, match=r"'0.2' reads as a figure and names a run folder .*\./0\.2 for the folder; .* 0\.2 or 20%"
    ):
        noise_floor_spec("0.2", tmp_path)
    assert noise_floor_spec("./0.2", tmp_path) == str((tmp_path / "0.2").resolve())
    assert noise_floor_spec(0.2, tmp_path) == "0.2"  # a recipe's number is a number
    assert noise_floor_spec("20%", tmp_path) == "0.2"
