"""``--budget``: the plan's arithmetic on given costs, and real tiny runs whose whole schedule fits the time, on a
clock the tests drive."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from flowers import budget
from flowers.cli import main
from flowers.data.resizing import size_at_epoch
from flowers.errors import ConfigError
from flowers.schedules import WarmupCosineLR
from flowers.stretch import checked, position, stretched
from tests.helpers.processes import DDP_RUN, probes, run_flowers
from tests.helpers.runs import TINY_RUN, fit_in, last_checkpoint

CONSTANT = budget.Costs(elapsed=10.0, step={128: 1.0}, batches_per_epoch=4, validation=2.0, checkpoint=0.5)


def same_side(epoch: int, epochs: int) -> int:
    return 128


def ramp(epoch: int, epochs: int) -> int:
    return size_at_epoch(epoch, epochs, start_size=96, final_size=144, ramp=(0.2, 0.8))


@pytest.mark.parametrize(("text", "seconds"), [("0:05:00", 300), ("5:00", 300), ("90", 90), ("1:00:00:00", 86400),
                                               ("0:00:02.5", 2.5)])
def test_a_budget_is_a_duration(text, seconds):
    assert budget.parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "1:2:3:4:5", "-0:05:00", "0:00:00", "inf"])
def test_anything_else_is_refused_in_one_line(text):
    with pytest.raises(ConfigError, match=r"--budget must be"):
        budget.parse_budget(text)


def test_the_plan_is_the_epochs_whose_whole_run_ends_nearest_the_budget():
    # 10 s spent, 1 s to end, and 4 steps of 1 s + last.ckpt 0.5 s + validation 2 s + best.ckpt 0.5 s an epoch.
    plan = budget.plan_epochs(CONSTANT, 60.0, same_side)
    assert (plan.epochs, plan.predicted_s) == (7, 60.0)  # 11 + 7 x 7 = 60; an eighth epoch would end at 67
    assert plan.describe() == "budget 0:01:00 → 7 epochs of 4 steps at 128 px (ends at about 0:01:00)"
    assert budget.plan_epochs(CONSTANT, 63.4, same_side).epochs == 7  # 3.4 s before; 8 would end 3.6 s past
    assert budget.plan_epochs(CONSTANT, 63.6, same_side).epochs == 8  # 3.6 s before; 8 end 3.4 s past


def test_epochs_that_do_not_validate_cost_no_validation():
    every_other = budget.Costs(**{**vars(CONSTANT), "validate_every": 2})
    # Two epochs: 2 x (4 + 0.5) + (2 + 0.5) = 11.5 s; 11 + 5 x 11.5 = 68.5.
    assert budget.predicted_seconds(every_other, 10, same_side) == 68.5
    never = budget.Costs(**{**vars(CONSTANT), "validate_every": None})
    assert budget.predicted_seconds(never, 10, same_side) == 11 + 10 * 4.5


def test_each_epoch_costs_its_own_side_of_the_resizing_schedule():
    costs = budget.Costs(elapsed=0.0, step={96: 1.0, 112: 2.0, 128: 3.0, 144: 4.0}, batches_per_epoch=1,
                         validation=0.0, checkpoint=0.0)
    assert [ramp(epoch, 10) for epoch in range(10)] == [96, 96, 96, 96, 112, 112, 128, 128, 144, 144]
    assert budget.predicted_seconds(costs, 10, ramp) == 1 + 4 * 1 + 2 * 2 + 2 * 3 + 2 * 4 == 23
    plan = budget.plan_epochs(costs, 23.0, ramp)
    assert plan.describe() == "budget 0:00:23 → 10 epochs of 1 steps at 96→144 px (ends at about 0:00:23)"


def test_a_budget_too_short_for_one_epoch_says_how_much_one_needs():
    with pytest.raises(ConfigError, match=r"too short for one epoch.*0:00:10 have passed.*at least --budget 0:00:22"):
        budget.plan_epochs(CONSTANT, 15.0, same_side)


def test_a_replan_keeps_the_most_epochs_whose_rest_ends_within_the_budget_at_the_pace_seen():
    # 10 s spent, 2 epochs done, 7 s an epoch as measured: 7 epochs end at 10 + 1 + 5 × 7 = 46 s, 2 s before 48;
    # 8 would end 5 s past it.
    assert budget.replan_epochs(CONSTANT, 48.0, now=10.0, done=2, pace=1.0, size_at=same_side) == (7, 46.0)
    # 1.5 × slower: 5 epochs end at 10 + 1 + 3 × 10.5 = 42.5 s, 5.5 s before; 6 end at 53 s, nearer past it.
    assert budget.replan_epochs(CONSTANT, 48.0, now=10.0, done=2, pace=1.5, size_at=same_side) == (6, 53.0)
    # Past the budget already: one more epoch, so that the schedule still ends.
    assert budget.replan_epochs(CONSTANT, 50.0, now=60.0, done=2, pace=1.0, size_at=same_side)[0] == 3
    assert budget.replan_epochs(CONSTANT, 500.0, now=10.0, done=2, pace=1.0, size_at=same_side, most=8)[0] == 8


def test_a_stretched_schedule_carries_on_from_where_it_is_and_ends_at_the_new_end():
    assert position(7, []) == 7
    knots = stretched([], at=4, end=10, new_end=16)  # 6 epochs left become 12
    assert [position(x, knots) for x in (0, 4, 10, 16)] == [0, 4, 7, 10]
    again = stretched(knots, at=10, end=16, new_end=13)  # then 6 left become 3: the schedule's last 3 epochs
    assert [position(x, again) for x in (4, 10, 11.5, 13)] == [4, 7, 8.5, 10]
    scheduler = WarmupCosineLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), total_steps=100)
    before = [scheduler.factor(step) for step in range(41)]
    scheduler.stretch(at_step=40, run_steps=100, new_run_steps=70)
    assert [scheduler.factor(step) for step in range(41)] == before and scheduler.factor(70) == 0.0
    # Halfway through the 30 steps left is where the unstretched schedule is at step 70, halfway through its 60.
    assert scheduler.factor(55) == pytest.approx(before_stretch(70))


def before_stretch(step: int) -> float:
    return WarmupCosineLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), total_steps=100).factor(step)


@pytest.mark.parametrize("knots", [[[1, 2, 3]], [[0, "1"]], [[0, float("nan")]], [[2, 0], [1, 1]], "knots",
                                   [[True, 1]]])
def test_a_checkpoints_stretch_is_data_checked_before_it_is_used(knots):
    with pytest.raises(ValueError, match="knots must be pairs|must increase"):
        checked(knots)


class EpochSides(L.Callback):
    """The side of each epoch's training images, as the model gets them."""

    def __init__(self) -> None:
        self.sides: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.sides.append(int(batch[0].shape[-1]))


class StopAfter(L.Callback):
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = trainer.current_epoch + 1 >= self.epochs


class FakeClock(L.Callback):
    """``budget``'s clock: each training step moves it on by ``seconds_per_step`` (its epoch's share of the
    validation and checkpoints included), so a run is as fast or as slow as a test says, on any machine."""

    now = 0.0

    def __init__(self, seconds_per_step: float) -> None:
        self.seconds_per_step = seconds_per_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        FakeClock.now = trainer.global_step * self.seconds_per_step


@pytest.fixture
def test_clock(monkeypatch):
    """A run that has just started when it plans (the test process itself has run for a while)."""
    FakeClock.now = 0.0
    monkeypatch.setattr(budget, "seconds_since_start", lambda: FakeClock.now)


BUDGET_RUN = [*TINY_RUN, "--trainer.limit_train_batches=4", "--data.start_image_size=64", "--data.image_size=80",
              "--data.resize_ramp=[0.2,0.5]",
              "--model.scheduler=flowers.schedules.WarmupCosineLR", "--model.scheduler_interval=step",
              "--trainer.callbacks+=tests.test_budget.EpochSides"]


def the(kind, trainer):
    return next(callback for callback in trainer.callbacks if isinstance(callback, kind))


def test_a_budget_sizes_the_whole_schedule_to_the_time_and_leaves_the_run_as_epochs_would(
        in_tmp, tiny_synthetic, test_clock, monkeypatch, caplog):
    monkeypatch.setattr(budget.TimeBudget, "_replan", lambda *args: None)  # the plan as measured; re-plans: below
    data = f"--data.data_dir={tiny_synthetic}"
    for name in ("budget", "epochs"):
        (in_tmp / name).mkdir()
    cli = fit_in(in_tmp / "budget", *BUDGET_RUN, data, "--budget=0:00:06")
    trainer, plan = cli.trainer, the(budget.TimeBudget, cli.trainer).plan
    assert trainer.max_epochs == plan.epochs and trainer.current_epoch == plan.epochs  # however many fit here
    assert plan.describe() in caplog.text
    # The cosine was sized to the plan: its last step is the run's last step.
    assert trainer.lr_scheduler_configs[0].scheduler.total_steps == trainer.global_step == plan.epochs * 4
    sides = the(EpochSides, trainer).sides
    assert len(sides) == plan.epochs and sides[-1] == plan.last_size
    # Measuring the speed drew no random number and moved no weight: the run is the one those epochs give.
    same = fit_in(in_tmp / "epochs", *BUDGET_RUN, data, f"--trainer.max_epochs={plan.epochs}")
    planned, fixed = (torch.load(last_checkpoint(in_tmp / name / "runs/flowers/version_0"), weights_only=True)
                      for name in ("budget", "epochs"))
    assert all(torch.equal(planned["state_dict"][key], value) for key, value in fixed["state_dict"].items())
    assert the(EpochSides, same.trainer).sides == sides


@pytest.fixture
def five_epochs(monkeypatch, test_clock):
    """Costs as if measured: 1 + 3 s an epoch, so a 16 s budget plans five epochs on any machine; the clock then
    moves on 0.75 s a step, 3 s an epoch, as measured."""
    costs = budget.Costs(elapsed=0.0, step={64: 0.5, 80: 0.5}, batches_per_epoch=4, validation=0.5, checkpoint=0.25)
    monkeypatch.setattr(budget, "measure", lambda *args: costs)
    return ["--budget=0:00:16", "--trainer.callbacks+=tests.test_budget.FakeClock",
            "--trainer.callbacks.init_args.seconds_per_step=0.75"]


def test_the_run_reaches_its_last_side_and_a_resumed_run_continues_its_plan(in_tmp, tiny_synthetic, five_epochs,
                                                                             monkeypatch, caplog):
    data = f"--data.data_dir={tiny_synthetic}"
    first = fit_in(in_tmp, *BUDGET_RUN, data, *five_epochs, "--trainer.callbacks+=tests.test_budget.StopAfter",
                   "--trainer.callbacks.init_args.epochs=2")
    plan = the(budget.TimeBudget, first.trainer).plan
    assert "budget 0:00:16 → 5 epochs of 4 steps at 64→80 px (ends at about 0:00:16)" in caplog.text
    assert first.trainer.current_epoch == 2  # stopped early, as a kill would

    def measure_again(*args):
        raise AssertionError("a resumed run measured its speed again")

    monkeypatch.setattr(budget, "measure", measure_again)
    resumed = fit_in(in_tmp, *BUDGET_RUN, data, "--ckpt_path=last")  # without --budget, too
    assert the(budget.TimeBudget, resumed.trainer).plan == plan
    assert resumed.trainer.current_epoch == 5 and the(EpochSides, resumed.trainer).sides == [64, 80, 80]
    assert resumed.trainer.lr_scheduler_configs[0].scheduler.total_steps == resumed.trainer.global_step == 20


def test_a_run_slower_than_measured_replans_and_still_ends_its_schedule_also_when_resumed(
        in_tmp, tiny_synthetic, five_epochs, monkeypatch, caplog):
    data = f"--data.data_dir={tiny_synthetic}"
    slow = [*five_epochs[:-1], "--trainer.callbacks.init_args.seconds_per_step=1.125"]  # 1.5 × the measured time
    first = fit_in(in_tmp, *BUDGET_RUN, data, *slow, "--trainer.callbacks+=tests.test_budget.StopAfter",
                   "--trainer.callbacks.init_args.epochs=2")
    # After epoch 1, 4.5 s have passed: two more epochs of 4.5 s end at 4.5 + 1 + 9 = 14.5 s, three would pass 16.
    assert "0:00:04 after epoch 1, the epochs take 1.50 × their measured time: 5 → 3 epochs" in caplog.text
    plan = the(budget.TimeBudget, first.trainer).plan
    assert (plan.epochs, plan.last_size) == (3, 80) and first.trainer.current_epoch == 2

    monkeypatch.setattr(budget, "measure", lambda *args: pytest.fail("a resumed run measured its speed again"))
    resumed = fit_in(in_tmp, *BUDGET_RUN, data, "--ckpt_path=last")
    trainer = resumed.trainer
    assert the(budget.TimeBudget, trainer).plan == plan
    assert trainer.current_epoch == 3 and the(EpochSides, trainer).sides == [80]  # the last side reached
    # The cosine, squeezed into 12 steps, ended on its final value after the last one.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == trainer.global_step == 12 and position(12, scheduler.knots) == 20
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.0
    assert trainer.datamodule.resize_knots == [[1.0, 1.0], [3.0, 5.0]]


@pytest.mark.parametrize("part", ["scheduler", "datamodule"])
def test_a_checkpoint_with_a_hostile_stretch_is_refused_in_one_line(in_tmp, tiny_synthetic, five_epochs, capsys,
                                                                    part):
    data = f"--data.data_dir={tiny_synthetic}"
    slow = [*five_epochs[:-1], "--trainer.callbacks.init_args.seconds_per_step=1.125"]
    first = fit_in(in_tmp, *BUDGET_RUN, data, *slow, "--trainer.callbacks+=tests.test_budget.StopAfter",
                   "--trainer.callbacks.init_args.epochs=2")
    path = last_checkpoint(in_tmp / first.trainer.log_dir)
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["lr_schedulers"][0] if part == "scheduler" else checkpoint[type(first.datamodule).__qualname__]
    state["knots" if part == "scheduler" else "resize_knots"] = [[3.0, 1.0], [1.0, "rm -rf"]]
    torch.save(checkpoint, path)
    capsys.readouterr()
    assert main(["fit", *BUDGET_RUN, data, "--ckpt_path=last"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("flowers: error: The checkpoint's") and "not one flowers wrote" in error
    assert error.count("\n") == 1


@pytest.mark.parametrize(("flags", "said"), [
    (["--budget=soon"], "--budget must be a duration"),
    (["--budget=0:05:00", "--trainer.max_steps=10"], "--budget 0:05:00 and --trainer.max_steps=10 both limit"),
    (["--budget=0:05:00", "--trainer.max_time=00:00:05:00"], "Unset --trainer.max_time"),
])
def test_settings_a_budget_cannot_work_with_stop_the_command_before_it_starts(in_tmp, tiny_synthetic, capsys, flags,
                                                                             said):
    assert main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("flowers: error: ") and said in error and error.count("\n") == 1
    assert not (in_tmp / "runs").exists()


def test_a_budget_already_spent_stops_with_how_much_one_epoch_needs(in_tmp, tiny_synthetic, monkeypatch, capsys):
    monkeypatch.setattr(budget, "seconds_since_start", lambda: 3600.0)
    assert main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", "--budget=0:30:00"]) == 2
    error = capsys.readouterr().err
    assert "--budget 0:30:00 is too short for one epoch: 1:00:00 have passed already" in error


@pytest.mark.slow
def test_every_ddp_process_runs_rank_zeros_plan(tmp_path, tiny_synthetic):
    output = run_flowers(["fit", *DDP_RUN, "--trainer.devices=2", "--trainer.limit_train_batches=2",
                          f"--data.data_dir={tiny_synthetic}", "--budget=0:00:45",
                          "--trainer.callbacks+=tests.helpers.callbacks.Probe",
                          f"--trainer.callbacks.init_args.out_dir={tmp_path / 'probe'}"], tmp_path, timeout=300)
    # The plan, then any re-plans: "budget 0:00:45: … after epoch 3, …: 60 → 57 epochs (ends at about …)".
    plans = [line for line in output.splitlines() if line.startswith("budget 0:00:45") and "→" in line]
    assert plans[0].startswith("budget 0:00:45 → ")
    epochs = int(plans[-1].rsplit("→ ", 1)[1].split()[0])
    ranks = probes(tmp_path / "probe", "fit")
    assert sorted(ranks) == [0, 1]
    assert [len(ranks[rank]["sampler_epochs"]) for rank in (0, 1)] == [epochs, epochs]


@pytest.mark.parametrize("plan", [{"epochs": 5}, {"budget_s": 16.0, "epochs": "5", "batches_per_epoch": 4,
                                                  "first_size": 64, "last_size": 80, "predicted_s": 16.0}, ["plan"]])
def test_a_checkpoints_plan_is_data_checked_before_it_is_used(plan):
    with pytest.raises(ConfigError, match="time-budget plan is not one flowers wrote"):
        budget.Plan.from_state(plan)


def test_a_run_set_in_epochs_is_not_resumed_under_a_budget(in_tmp, tiny_synthetic, capsys):
    data = f"--data.data_dir={tiny_synthetic}"
    fit_in(in_tmp, *TINY_RUN, data, "--trainer.limit_train_batches=2", "--trainer.max_epochs=2",
           "--trainer.callbacks+=tests.test_budget.StopAfter", "--trainer.callbacks.init_args.epochs=1")
    assert main(["fit", *TINY_RUN, data, "--trainer.limit_train_batches=2", "--budget=0:05:00",
                 "--ckpt_path=last"]) == 2
    assert "--budget was given to resume a run that was not planned by a budget" in capsys.readouterr().err
