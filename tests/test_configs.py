"""Every YAML in configs/ parses and instantiates (run=False), alone and composed.

Mode files that need GPUs (gpu, dp, ddp, multinode) are instantiated with the accelerator overridden
to one CPU, so their strategy, precision and num_nodes are still built; their GPU runs are in
tests/gpu/test_modes.py (`make test-gpu`).
"""

from pathlib import Path

import pytest
import yaml

from flowers.cli import cli_main

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
MODES = ("cpu", "gpu", "dp", "ddp", "ddp_cpu", "multinode")


def on_this_machine(config: Path) -> list[str]:
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer", {})
    if trainer.get("accelerator") in ("gpu", "cuda"):
        return ["--trainer.accelerator=cpu", "--trainer.devices=1"]
    return []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates(config, in_tmp, tiny_synthetic):
    cli = cli_main(["--config", str(config), *on_this_machine(config), f"--data.data_dir={tiny_synthetic}"],
                   run=False)
    assert cli.model.class_names == cli.datamodule.class_names


@pytest.mark.parametrize("mode", MODES)
def test_mode_files_set_only_trainer_keys_and_compose(mode, in_tmp, tiny_synthetic):
    root = CONFIGS[0].parent
    assert set(yaml.safe_load((root / f"{mode}.yaml").read_text())) == {"trainer"}
    mode_file = root / f"{mode}.yaml"
    cli = cli_main(["--config", str(root / "tutorial.yaml"), "--config", str(mode_file), *on_this_machine(mode_file),
                    f"--data.data_dir={tiny_synthetic}"], run=False)
    assert cli.datamodule.image_size == 224 and cli.trainer.max_epochs == 10  # the experiment's keys survive
    trainer = yaml.safe_load(mode_file.read_text())["trainer"]
    expected = {"dp": "DataParallelStrategy", "ddp": "DDPStrategy"}.get(trainer.get("strategy"), "SingleDeviceStrategy")
    assert type(cli.trainer.strategy).__name__ == expected
    assert cli.trainer.num_nodes == trainer.get("num_nodes", 1)


def test_configs_compose_later_files_win(in_tmp, tiny_synthetic):
    root = CONFIGS[0].parent
    cli = cli_main(["--config", str(root / "tutorial.yaml"), "--config", str(root / "quickstart.yaml"),
                    f"--data.data_dir={tiny_synthetic}"], run=False)
    assert cli.datamodule.image_size == 64 and cli.trainer.max_epochs == 24
    assert cli.datamodule.crop_scale == (0.6, 1.0)


def test_print_config_prints_the_composed_yaml(in_tmp, capsys):
    root = CONFIGS[0].parent
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(root / "quickstart.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "image_size: 64" in printed and "monitor: val/acc" in printed
