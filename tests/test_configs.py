"""Every YAML in configs/ parses and instantiates (run=False), alone and composed."""

from pathlib import Path

import pytest

from flowers.cli import cli_main

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_instantiates(config, in_tmp, tiny_synthetic):
    cli = cli_main(["--config", str(config), f"--data.data_dir={tiny_synthetic}"], run=False)
    assert cli.model.class_names == cli.datamodule.class_names


def test_configs_compose_later_files_win(in_tmp, tiny_synthetic):
    root = CONFIGS[0].parent
    cli = cli_main(["--config", str(root / "seed.yaml"), "--config", str(root / "quickstart.yaml"),
                    f"--data.data_dir={tiny_synthetic}"], run=False)
    assert cli.datamodule.image_size == 64 and cli.trainer.max_epochs == 12


def test_print_config_prints_the_composed_yaml(in_tmp, capsys):
    root = CONFIGS[0].parent
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(root / "quickstart.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "image_size: 64" in printed and "monitor: val/acc" in printed
