"""The drivers' messages (hfscale.sweep.messages): each read back as it was written, and a foreign one refused by
name, before it can name a folder or a launch."""

from __future__ import annotations

import json

import pytest
from helpers.runs import write_recipe

from hfscale.launch.plan import PlannedRun, SweepSettings
from hfscale.recipes.recipe import load_recipe
from hfscale.sweep.messages import MachineReport, MessageError, StartDecision, SweepPlan

RECIPE = {
    "name": "two",
    "device": "cpu",
    "model": {"config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}},
    "data": {"num_samples": 16, "seq_len": 16},
    "measure": {"warmup_steps": 0},  # an epoch is 2 steps of 4 samples on each of 2 processes
    "run": {"env": {"OMP_NUM_THREADS": "1"}, "memory_limit_gib": 4.0},
    "defaults": {"per_device_batch_size": 4, "num_processes": 2, "num_machines": 2},
    "trials": [{"name": "ddp"}, {"name": "ddp-ckpt", "gradient_checkpointing": True}],
}


def _plan(tmp_path) -> SweepPlan:
    trials = load_recipe(write_recipe(tmp_path, RECIPE)).trials
    runs = (PlannedRun(trial=trials[0], repeat=0, index=0), PlannedRun(trial=trials[1], repeat=1, index=3))
    settings = SweepSettings(num_machines=2, timeout_s=60.0, only=("ddp", "ddp-ckpt"))
    return SweepPlan(sweep_id="a" * 32, host="node0", run_dir=str(tmp_path / "run"), recipe="two", settings=settings,
                     runs=runs)  # fmt: skip


def test_a_plan_is_read_back_as_machine_0_wrote_it(tmp_path):
    plan = _plan(tmp_path)
    back = SweepPlan.from_json(json.loads(json.dumps(plan.to_json())))  # as the channel carries it
    assert (back.sweep_id, back.host, back.run_dir, back.recipe, back.settings) == (
        plan.sweep_id, plan.host, plan.run_dir, plan.recipe, plan.settings,
    )  # fmt: skip
    assert [(r.index, r.repeat, r.name) for r in back.runs] == [(0, 0, "ddp"), (3, 1, "ddp-ckpt")]
    for sent, got in zip(plan.runs, back.runs, strict=True):
        assert got.trial.spec == sent.trial.spec and got.trial.run == sent.trial.run
    assert back.to_json() == plan.to_json()


def test_a_plan_that_names_a_path_or_lacks_a_field_is_refused_by_name(tmp_path):
    wire = _plan(tmp_path).to_json()
    with pytest.raises(MessageError, match=r"machine 0's plan names recipe '\.\./\.\./etc', not a file name"):
        SweepPlan.from_json({**wire, "recipe": "../../etc"})
    with pytest.raises(MessageError, match=r"names recipe None"):
        SweepPlan.from_json(["not", "a", "plan"])
    without = {k: v for k, v in wire.items() if k != "runs"}
    with pytest.raises(MessageError, match=r"cannot be read: runs: KeyError: 'runs'; run the same hfscale"):
        SweepPlan.from_json(without)
    with pytest.raises(MessageError, match=r"cannot be read: settings: AttributeError"):
        SweepPlan.from_json({**wire, "settings": ["not", "a", "mapping"]})
    broken = {**wire, "runs": [wire["runs"][0], {**wire["runs"][1], "repeat": "x"}]}
    with pytest.raises(MessageError, match=r"cannot be read: runs\[1\]: ValueError"):
        SweepPlan.from_json(broken)
    with pytest.raises(MessageError, match=r"has sweep_id '\.\./x', not a file name"):
        SweepPlan.from_json({**wire, "sweep_id": "../x"})


def test_a_start_decision_is_launch_only_when_it_says_so():
    for decision in (StartDecision(action="launch"), StartDecision(action="skip", reason="a machine did not come")):
        assert StartDecision.from_json(json.loads(json.dumps(decision.to_json()))) == decision
    assert StartDecision(action="launch").to_json() == {"action": "launch"}
    assert StartDecision.from_json({"action": "later"}) == StartDecision(action="skip")
    assert StartDecision.from_json(None) == StartDecision(action="skip")


def test_a_machine_report_is_read_back_and_ignores_fields_of_another_version():
    report = MachineReport(machine=1, status="oom", reason="CUDA out of memory", exit_code=1, failed_rank=3,
                           ranks=[2, 3], host="node1", log_dir="machines/machine-1/trials/ddp")  # fmt: skip
    assert MachineReport.from_json({**report.to_json(), "added_later": True}) == report
