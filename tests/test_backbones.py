"""Backbones, pretrained weights, fine-tuning and starting from another run: all offline.

Pretrained files are made here from torchvision models; the weights-name path reads them from a
torchvision cache folder filled beforehand, with downloading made to fail.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import onnxruntime
import pytest
import torch
from torchvision import models

from flowers import backbones
from flowers.analysis import datamodule_for, evaluate, load, predict
from flowers.cli import cli_main
from flowers.errors import ConfigError
from flowers.export import export
from tests.helpers.processes import run_flowers
from tests.helpers.runs import TINY_RUN

FIT = [*TINY_RUN, "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", "--seed_everything=3"]


def net_state(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.net.state_dict().items()}


@pytest.fixture
def no_downloads(monkeypatch):
    """Any attempt to fetch weights fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr("urllib.request.urlopen", refuse)


@pytest.fixture
def resnet_run(backbone_run) -> Path:
    return backbone_run("resnet18")


@pytest.mark.parametrize("name, head", [("tutorial_alexnet", "classifier.6"), ("resnet18", "fc"),
                                        ("mobilenet_v3_large", "classifier.3"), ("vit_b_16", "heads.head")])
def test_each_backbone_gets_a_head_for_the_datas_classes(name, head):
    with torch.device("meta"):
        net = backbones.build(name, 7)
    assert backbones.head_name(net) == head and backbones.head_key(name) == f"{head}.weight"
    assert net.get_submodule(head).weight.shape[0] == 7


def test_an_unknown_backbone_and_unknown_weights_are_refused_by_name():
    with pytest.raises(ConfigError, match="'resnet19' is not a backbone"):
        backbones.build("resnet19", 5)
    with pytest.raises(ConfigError, match="IMAGENET9K_V7.*IMAGENET1K_V1"):
        backbones.preprocessing("resnet18", "IMAGENET9K_V7")
    with pytest.raises(ConfigError, match="no weights for tutorial_alexnet"):
        backbones.preprocessing("tutorial_alexnet", "DEFAULT")
    assert backbones.preprocessing("resnet18", "DEFAULT").mean == (0.485, 0.456, 0.406)
    assert backbones.preprocessing("tutorial_alexnet", None) == backbones.TUTORIAL_PREPROCESSING


def test_a_torchvision_state_dict_loads_into_the_body_and_its_imagenet_head_starts_fresh(tmp_path):
    source = models.mobilenet_v3_small()  # torchvision's 1000-class head, as its own weights files hold
    path = tmp_path / "mobilenet.pth"
    torch.save(source.state_dict(), path)
    net = backbones.build("mobilenet_v3_small", 5)
    fresh_head = net.classifier[3].weight.clone()
    with pytest.warns(UserWarning, match=r"head \(classifier.3: \(1000, 1024\) in the file, \(5, 1024\) here\)"):
        kept = backbones.load_weights(net, "mobilenet_v3_small", str(path))
    assert kept == ["classifier.3.weight", "classifier.3.bias"]
    assert torch.equal(net.features[0][0].weight, source.features[0][0].weight)
    assert torch.equal(net.classifier[3].weight, fresh_head)

    with pytest.raises(ConfigError, match=r"mobilenet.pth does not fit --model.backbone=resnet18"):
        backbones.load_weights(backbones.build("resnet18", 5), "resnet18", str(path))
    (tmp_path / "junk.pth").write_bytes(b"not a state_dict")
    with pytest.raises(ConfigError, match="cannot be read as a state_dict file"):
        backbones.load_weights(net, "mobilenet_v3_small", str(tmp_path / "junk.pth"))


def test_weights_by_name_come_from_torchvisions_cache_and_resume_reads_none(in_tmp, tiny_synthetic, monkeypatch,
                                                                           no_downloads):
    monkeypatch.setenv("TORCH_HOME", str(in_tmp / "torch"))
    weights = models.get_model_weights("mobilenet_v3_small").IMAGENET1K_V1
    pretrained = models.mobilenet_v3_small()
    cache = in_tmp / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(pretrained.state_dict(), cache / Path(weights.url).name)

    args = ["fit", *FIT, f"--data.data_dir={tiny_synthetic}", "--model.backbone=mobilenet_v3_small",
            "--model.weights=IMAGENET1K_V1", "--model.freeze_backbone_epochs=1"]
    with pytest.warns(UserWarning, match="classifier head"):
        cli = cli_main(args)
    assert torch.equal(cli.model.net.features[0][0].weight, pretrained.features[0][0].weight)
    # The data follow the weights' normalisation, and the run records it.
    assert cli.datamodule.mean == list(weights.transforms().mean) == cli.model.hparams.mean
    assert "0.485" in (Path(cli.trainer.log_dir) / "config.yaml").read_text()

    (cache / Path(weights.url).name).unlink()  # resume and predict rebuild the network from the checkpoint
    resumed = cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    assert resumed.trainer.global_step == 6 and resumed.model.normalisation()[0] == tuple(weights.transforms().mean)


def test_named_weights_that_cannot_be_downloaded_get_one_clear_error(in_tmp, tiny_synthetic, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(in_tmp / "torch"))

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(ConfigError, match="could not be downloaded.*hub/checkpoints"):
        cli_main(["fit", *FIT, f"--data.data_dir={tiny_synthetic}", "--model.backbone=mobilenet_v3_small",
                  "--model.weights=DEFAULT"])


@pytest.mark.parametrize("backbone", ["resnet18", pytest.param("mobilenet_v3_small", marks=pytest.mark.slow)])
def test_another_backbone_trains_predicts_exports_and_is_analysed(backbone, tiny_synthetic, tmp_path, backbone_run):
    ckpt = backbone_run(backbone) / "checkpoints" / "last.ckpt"
    model, class_names, hparams = load(ckpt)
    assert hparams["backbone"] == backbone and model.normalisation()[0] == (0.485, 0.456, 0.406)
    datamodule = datamodule_for(ckpt, model)
    assert datamodule.mean == [0.485, 0.456, 0.406]  # the run's own normalisation, for a fair score
    result = evaluate(model, datamodule)
    # The whole validation split is scored, each image once, and the accuracy is the confusion matrix's diagonal.
    assert int(result.confusion.sum()) == len(datamodule.val_set) == len(result.labels)
    assert result.accuracy == pytest.approx(float(result.confusion.trace()) / len(datamodule.val_set))
    assert result.accuracy == pytest.approx(float((result.probs.argmax(1) == result.labels).float().mean()))
    image = next(tiny_synthetic.rglob("*.png"), None) or next(tiny_synthetic.rglob("*.jpg"))
    (row,) = predict(model, [image], image_size=64)
    assert row["prediction"] in class_names

    names = {fmt: export(ckpt, fmt, tmp_path, image_size=64).name for fmt in ("state_dict", "torchscript", "onnx")}
    assert names == {"state_dict": f"{backbone}.pth", "torchscript": f"{backbone}.torchscript.pt",
                     "onnx": f"{backbone}.onnx"}
    plain = models.get_model(backbone, num_classes=len(class_names)).eval()
    plain.load_state_dict(torch.load(tmp_path / f"{backbone}.pth", weights_only=True))
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(torch.jit.load(str(tmp_path / f"{backbone}.torchscript.pt"))(x), plain(x))
    session = onnxruntime.InferenceSession(str(tmp_path / f"{backbone}.onnx"))
    (logits,) = session.run(None, {"images": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(logits), plain(x), atol=1e-4, rtol=1e-4)


def test_init_from_starts_a_new_run_from_another_runs_network(resnet_run, tmp_path, tiny_synthetic, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = resnet_run / "checkpoints" / "last.ckpt"
    source = torch.load(ckpt, weights_only=True)["state_dict"]
    args = ["fit", *FIT, "--model.backbone=resnet18", f"--model.init_from={ckpt}", "--trainer.max_steps=0"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = cli_main([*args, f"--data.data_dir={tiny_synthetic}"])
    assert not [w for w in caught if "classifier head" in str(w.message)]  # same classes: the whole network
    assert all(torch.equal(same.model.net.state_dict()[k], source[f"net.{k}"]) for k in same.model.net.state_dict())
    assert same.trainer.global_step == 0 and same.trainer.current_epoch == 0  # not its epoch nor its optimizer

    fewer = tmp_path / "three"
    for name in ("daisy", "rose", "tulip"):
        shutil.copytree(tiny_synthetic / name, fewer / name)
    with pytest.warns(UserWarning, match=r"head \(fc: \(5, 512\) in the file, \(3, 512\) here\)"):
        three = cli_main([*args, f"--data.data_dir={fewer}"])
    assert torch.equal(three.model.net.conv1.weight, source["net.conv1.weight"])

    with pytest.raises(ConfigError, match="holds a resnet18 network, not the --model.backbone=mobilenet_v3_small"):
        cli_main([*args, f"--data.data_dir={tiny_synthetic}", "--model.backbone=mobilenet_v3_small"])


def test_freezing_trains_only_the_head_then_everything_and_the_head_has_its_own_rate(in_tmp, tiny_synthetic):
    args = ["fit", *FIT, f"--data.data_dir={tiny_synthetic}", "--model.backbone=mobilenet_v3_small",
            "--model.freeze_backbone_epochs=1", "--model.head_lr=0.01", "--model.optimizer=SGD",
            "--model.optimizer.init_args.lr=0.001", "--model.optimizer.init_args.momentum=0.9"]
    start = cli_main([*args, "--trainer.max_steps=0"])
    first = cli_main([*args, "--trainer.max_epochs=1"])
    (optimizer,) = first.trainer.optimizers
    assert [group["lr"] for group in optimizer.param_groups] == [0.001, 0.01]
    before, after = net_state(start), net_state(first)
    head = backbones.head_name(first.model.net) + "."
    for name, _ in first.model.net.named_parameters():  # the head moved, the body's weights did not
        assert torch.equal(before[name], after[name]) != name.startswith(head), name
    body, _ = backbones.head_parameters(first.model.net)
    assert all(optimizer.state.get(p) in (None, {}) for p in body)  # skipped whole: no momentum for the body

    second = cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last"])
    trained = net_state(second)
    assert not torch.equal(trained["features.0.0.weight"], after["features.0.0.weight"])


def test_resuming_names_every_model_setting_the_checkpoint_overrides(in_tmp, tiny_synthetic):
    args = ["fit", *FIT, f"--data.data_dir={tiny_synthetic}"]
    cli_main([*args, "--model.optimizer=SGD", "--model.optimizer.init_args.lr=0.05"])
    with pytest.warns(UserWarning) as caught:
        cli_main([*args, "--trainer.max_epochs=2", "--ckpt_path=last", "--model.optimizer=SGD",
                  "--model.optimizer.init_args.lr=0.1", "--model.label_smoothing=0.2", "--model.compile=false"])
    (message,) = [str(w.message) for w in caught if "Resuming from a checkpoint keeps" in str(w.message)]
    assert "--model.optimizer.init_args.lr=0.1 (the checkpoint's: 0.05)" in message
    assert "--model.label_smoothing=0.2 (the checkpoint's: 0.0)" in message
    assert "compile" not in message  # how a model runs follows the command, so nothing is dropped


def test_dp_fits_another_backbone(in_tmp, tiny_synthetic):
    with pytest.warns(UserWarning, match="strategy=dp without CUDA"):
        cli = cli_main(["fit", *FIT, f"--data.data_dir={tiny_synthetic}", "--model.backbone=mobilenet_v3_small",
                        "--trainer.strategy=dp", "--trainer.limit_train_batches=2"])
    keys = torch.load(Path(cli.trainer.log_dir) / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert "net.classifier.3.weight" in keys and not any(".module." in key for key in keys)


@pytest.mark.slow
def test_ddp_fits_another_backbone_from_a_weights_file_on_every_rank(tmp_path, tiny_synthetic):
    backbone = "mobilenet_v3_small"  # its batch norms and frozen features: what ddp must keep the same on each rank
    pretrained = models.get_model(backbone)
    torch.save(pretrained.state_dict(), tmp_path / "pretrained.pth")
    output = run_flowers(["fit", *FIT, f"--data.data_dir={tiny_synthetic}", f"--model.backbone={backbone}",
                      "--model.weights=pretrained.pth", "--model.freeze_backbone_epochs=1",
                      "--trainer.strategy=ddp", "--trainer.devices=2"], tmp_path)
    assert "classifier head" in output
    state = torch.load(tmp_path / "runs/flowers/version_0/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    first_conv = next(name for name, p in pretrained.named_parameters() if p.dim() == 4)
    assert torch.equal(state[f"net.{first_conv}"], pretrained.state_dict()[first_conv])  # frozen, as loaded
