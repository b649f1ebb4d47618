"""hfscale.commands.estimate: ``hfscale estimate`` as a user runs it (table, JSON, recipes, errors without
tracebacks)."""

from __future__ import annotations

import json

import pytest

from hfscale.commands.estimate import main
from hfscale.core.units import GIB
from hfscale.estimate import CUDA_CONTEXT_BYTES

SMALL = ["--config", "hidden_size=64", "--config", "num_hidden_layers=2", "--config", "num_attention_heads=2"]


def test_cli_table(capsys):
    model = ["--config", "hidden_size=128", "--config", "num_hidden_layers=2", "--config", "num_attention_heads=2"]
    code = main(["bert", *model, "--seq-len", "128", "--batch-size", "4", "--memory-budget", "2GiB"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("fp32", "bf16-ckpt", "bf16-adam8bit", "bf16-zero3-offload"):
        assert f"\n{name} " in out
    assert "budget 2.00 GiB" in out


def test_cli_json_and_recipe(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "device: cpu\n"
        "model: {type: bert, config: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2}}\n"
        "data: {seq_len: 64}\n"
        "trials:\n  - name: fp32\n  - {name: ckpt, gradient_checkpointing: true}\n",
        encoding="utf-8",
    )
    assert main([str(recipe), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["trial"] for r in rows] == ["fp32", "ckpt"]
    assert rows[1]["estimate"]["activations_gib"] < rows[0]["estimate"]["activations_gib"]


def test_cli_reports_errors(capsys):
    assert main(["no-such-model-type"]) == 2
    assert "hfscale estimate:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bert", "--num-gpus", "0"], "argument --num-gpus: expected a positive integer"),
        (["bert", "--seq-len", "-1"], "argument --seq-len: expected a positive integer"),
        (["bert", "--config", "hidden_size"], "argument --config: --config expects key=value"),
        (["bert", "--config", "hidden_size=-5"], "--config hidden_size: expected a positive integer, got -5"),
        (["bert", "--config", "hidden_size=abc"], "--config hidden_size: expected a positive integer, got 'abc'"),
        (["bert", "--config", "hidden_dropout_prob=abc"], "--config: Validation error for field 'hidden_dropout_prob'"),
    ],
)
def test_cli_rejects_bad_arguments_without_a_traceback(argv, expected, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_cli_header_says_the_cuda_context_is_assumed(capsys):
    assert main(["bert", *SMALL, "--seq-len", "32", "--memory-budget", "2GiB"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"+ {CUDA_CONTEXT_BYTES / GIB:.2f} GiB CUDA context" in header and "assumed, not measured" in header
    assert "docs/estimate.md" in header


def test_cli_prints_nothing_that_points_outside_the_repository(capsys):
    """Every path the product prints must exist in a checkout (no gitignored run folders, no ../shared)."""
    assert main(["bert", *SMALL, "--seq-len", "32", "--num-gpus", "2", "--memory-budget", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "shared/" not in out and "runs/" not in out
