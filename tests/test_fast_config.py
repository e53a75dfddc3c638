"""`fit` on the fast path (cache, batched augmentation, channels_last, bf16-mixed) trains end to end."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from flowers.cli import cli_main
from flowers.data import FlowerDataModule
from flowers.data.batch_augment import CachedTrainBatch
from flowers.data.cache import CACHE_FOLDER
from flowers.data.datasets import CachedBatch
from flowers.module import FlowerClassifier
from flowers.runs import last_checkpoint
from flowers.schedules import WarmupCosineLR
from tests.helpers.images import make_tree
from tests.helpers.ops import RecordOps
from tests.helpers.runs import TINY_RUN

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHORT = ["--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2"]


def test_fit_with_the_cache_trains_through_the_cli(in_tmp):
    data = make_tree(in_tmp / "photos", {"a": 10, "b": 10}, size=80)
    cli = cli_main(["fit", "--config", str(CONFIGS / "fast.yaml"), *TINY_RUN, *SHORT, f"--data.data_dir={data}",
                    "--data.cache=true", "--model.channels_last=true", "--trainer.precision=bf16-mixed"])
    trainer = cli.trainer
    assert trainer.global_step == 3 and trainer.precision == "bf16-mixed"
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    assert cli.model.net.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert trainer.optimizers[0].defaults["fused"] is True  # fast.yaml's fused_optimizer
    # Batches are built in the model's layout, and on CPU by the training process itself.
    assert FlowerDataModule(str(data), cache=True).num_workers == 0
    assert FlowerDataModule(str(data)).num_workers == min(os.cpu_count(), 32, 8)
    batch = next(iter(cli.datamodule.train_dataloader()))  # views drawn by the loader
    assert isinstance(batch, CachedTrainBatch) and batch.squares_or_indices.dtype == torch.uint8
    assert batch.boxes.shape == (len(batch.labels), 4) and batch.flip.dtype == torch.bool
    assert cli.datamodule.channels_last  # the model's setting, read from the model the data feeds
    images, _ = cli.datamodule.on_after_batch_transfer(batch, 0)
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    # The cache and its lock file, beside the record of checked images.
    assert len([p for p in (data / CACHE_FOLDER).iterdir() if not p.name.startswith("verified-")]) == 2
    assert Path(last_checkpoint(trainer)).is_file()
    # The next run finds the same cache.
    again = FlowerDataModule(str(data), image_size=64, cache=True)
    again.setup("fit")
    assert again.train_set.cache.folder == cli.datamodule.train_set.cache.folder


def test_a_training_step_reads_nothing_back_to_the_host(tiny_synthetic, tmp_path):
    # On a GPU the host queues each step's kernels ahead of the device; an operation whose result the host
    # must read (an item(), a data-dependent size, a tensor built from host data) makes it wait for the queue
    # to drain, every step. Recorded here on CPU, the operations of whole training steps (forward, loss,
    # metrics, logging, backward, optimizer) on the fast path must include none of them.
    host_reads = {"_local_scalar_dense", "bincount", "histc", "nonzero", "masked_select", "unique", "_unique2",
                  "unique_dim", "unique_consecutive", "repeat_interleave", "lift_fresh"}

    class RecordSteps(L.Callback):
        def __init__(self) -> None:
            self.mode, self.steps = RecordOps(), 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx > 0:  # the first step also builds the optimizer's state
                self.mode.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx > 0:
                self.mode.__exit__(None, None, None)
                self.steps += 1

    record = RecordSteps()
    data = FlowerDataModule(str(tiny_synthetic), image_size=64, batch_size=8, cache=True, num_workers=0)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=4, limit_val_batches=0,
                        precision="bf16-mixed", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record], default_root_dir=tmp_path)
    trainer.fit(FlowerClassifier(data.num_classes, channels_last=True, fused_optimizer=True), datamodule=data)
    ops = set(record.mode.ops)
    assert record.steps == 3 and {"convolution_backward", "_fused_adam_"} <= ops
    assert not host_reads & ops, host_reads & ops


def test_best_recipe_warms_up_then_decays(in_tmp, tiny_synthetic):
    cli = cli_main(["fit", "--config", str(CONFIGS / "best.yaml"), *TINY_RUN, "--trainer.precision=32-true",
                    "--data.batch_size=4", f"--data.data_dir={tiny_synthetic}", "--trainer.max_steps=6",
                    "--trainer.limit_val_batches=1"])
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps == 6
    assert scheduler.factor(0) == pytest.approx(0.1) and scheduler.factor(6) == pytest.approx(0.0)
    assert max(scheduler.factor(s) for s in range(7)) == pytest.approx(1.0, abs=0.2)
    assert cli.model.eval_hflip is True


def test_compile_and_channels_last_keep_the_checkpoint_keys():
    plain = FlowerClassifier(5).state_dict()
    fast = FlowerClassifier(5, channels_last=True, compile=True).state_dict()
    assert list(fast) == list(plain)
    assert fast["net.features.0.weight"].is_contiguous(memory_format=torch.channels_last)


def test_compile_mode_reaches_torch_compile(monkeypatch):
    # "reduce-overhead" (CUDA graphs) is the mode that matters on a GPU, which CI lacks: check it is the
    # mode torch.compile is given (it compiles lazily, at the first forward), and unset means torch's default.
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, *args, mode=None, **kwargs: modes.append(mode) or fn)
    FlowerClassifier(5, compile=True, compile_mode="reduce-overhead")
    FlowerClassifier(5, compile=True)
    FlowerClassifier(5, compile_mode="reduce-overhead")  # ignored without compile
    assert modes == ["reduce-overhead", None]


@pytest.mark.slow
def test_a_compiled_run_with_cuda_graph_mode_trains_and_saves_plain_keys(in_tmp, tiny_synthetic):
    # compile_mode=reduce-overhead is meant for GPUs (CUDA graphs); on CPU it must still compile and train,
    # with best.yaml's two-view evaluation in the same compiled network (about a minute of compiling).
    cli = cli_main(["fit", "--config", str(CONFIGS / "best.yaml"), *TINY_RUN, f"--data.data_dir={tiny_synthetic}",
                    "--model.compile=true", "--model.compile_mode=reduce-overhead", "--trainer.max_epochs=1",
                    "--trainer.check_val_every_n_epoch=1", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=1", "--trainer.precision=32-true"])
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["val/loss"])
    saved = torch.load(last_checkpoint(cli.trainer), weights_only=True)
    assert saved["hyper_parameters"]["compile_mode"] == "reduce-overhead"
    assert list(saved["state_dict"]) == list(FlowerClassifier(5).state_dict())


@pytest.mark.parametrize("cache", [False, True])
def test_eval_image_size_sets_the_validation_squares_only(in_tmp, cache):
    from flowers.data.cache import cache_side

    data = make_tree(in_tmp / "photos", {"a": 6, "b": 6}, size=120)
    module = FlowerDataModule(str(data), image_size=64, eval_image_size=80, batch_size=4, num_workers=0, cache=cache)
    module.setup("fit")
    train, val = next(iter(module.train_dataloader())), next(iter(module.val_dataloader()))
    module.trainer = type("Trainer", (), {"training": True})()
    assert module.on_after_batch_transfer(train, 0)[0].shape[-2:] == (64, 64)
    module.trainer.training = False
    assert module.on_after_batch_transfer(val, 0)[0].shape[-2:] == (80, 80)
    if cache:  # one cache, large enough for the bigger of the two
        assert module.train_set.cache.pixels.shape[-1] == cache_side(80)
        module.trainer.training = True  # a training batch without its views is an error, not an eval batch
        with pytest.raises(RuntimeError, match="WithTrainViews"):
            module.on_after_batch_transfer(val, 0)
    assert FlowerDataModule(str(data), image_size=64).eval_image_size == 64


@pytest.mark.parametrize(("arg", "message"), [
    ("--data.image_size=32", "data.image_size=32 is too small"),
    ("--data.eval_image_size=32", "data.eval_image_size=32 is too small"),
])
def test_image_sizes_too_small_for_the_network_are_config_errors(in_tmp, tiny_synthetic, arg, message):
    from flowers.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        cli_main(["fit", *TINY_RUN, f"--data.data_dir={tiny_synthetic}", arg])


def test_the_cache_never_upsamples_small_photos(in_tmp):
    # 60-px photos for 64-px crops: cached as they are, not at 73 px; the crops upsample once, as PIL's do.
    data = make_tree(in_tmp / "photos", {"a": 4, "b": 4}, size=60)
    module = FlowerDataModule(str(data), image_size=64, batch_size=4, num_workers=0, cache=True)
    module.setup("fit")
    assert module.train_set.cache.pixels.shape[-2:] == (60, 60)


@pytest.mark.parametrize("optimizer", [
    None,  # the tutorial's Adam
    {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9, "nesterov": True,
                                                     "weight_decay": 5e-4}},
    {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, "weight_decay": 0.05}},
])
def test_the_fused_optimizer_keeps_the_settings_and_the_update(optimizer, in_tmp, tiny_synthetic):
    import yaml

    args = ["fit", *TINY_RUN, "--trainer.max_steps=0", f"--data.data_dir={tiny_synthetic}"]
    if optimizer is not None:
        (in_tmp / "opt.yaml").write_text(yaml.safe_dump({"model": {"optimizer": optimizer}}))
        args += ["--config", str(in_tmp / "opt.yaml")]
    factory = cli_main(args).model.optimizer_factory
    images, labels = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    params, optimizers = [], []
    for fused in (False, True):
        torch.manual_seed(0)  # same weights and the same dropout masks
        model = FlowerClassifier(5, optimizer=factory, fused_optimizer=fused)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        step = model.make_optimizer()
        for _ in range(3):
            step.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            step.step()
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        optimizers.append(step)
    plain, fused = optimizers
    assert not plain.defaults["fused"] and fused.defaults["fused"] is True and type(fused) is type(plain)
    assert {k: v for k, v in fused.defaults.items() if k not in ("fused", "foreach")} == \
        {k: v for k, v in plain.defaults.items() if k not in ("fused", "foreach")}
    # The same three updates up to float rounding. Adam divides by sqrt(v) + eps, which magnifies rounding
    # where gradients are near zero: there a weight can differ by up to a step. So: nearly every weight
    # within 5 % of the largest move, and on average within 1 % of the average move.
    moved = (params[0] - start).abs()
    difference = (params[1] - params[0]).abs()
    assert moved.max() > 0
    assert (difference > 0.05 * moved.max()).float().mean() < 1e-4
    assert difference.mean() < 0.01 * moved.mean()


def test_an_optimizer_with_no_fused_kernel_is_kept(in_tmp):
    from functools import partial

    model = FlowerClassifier(5, optimizer=partial(torch.optim.RMSprop, lr=1e-3), fused_optimizer=True)
    optimizer = model.make_optimizer()
    assert isinstance(optimizer, torch.optim.RMSprop) and "fused" not in optimizer.defaults


def test_eval_hflip_scores_an_image_and_its_mirror_alike():
    torch.manual_seed(0)
    images = torch.randn(3, 3, 64, 64)
    plain = FlowerClassifier(5).eval()
    tta = FlowerClassifier(5, eval_hflip=True).eval()
    tta.load_state_dict(plain.state_dict())
    with torch.no_grad():
        mirrored = (plain(images) + plain(images.flip(-1))) / 2
        torch.testing.assert_close(tta.eval_logits(images), mirrored)
        torch.testing.assert_close(tta.eval_logits(images.flip(-1)), tta.eval_logits(images))
        assert not torch.allclose(plain.eval_logits(images.flip(-1)), plain.eval_logits(images))
        # predict uses the same view as validation
        probs = tta.predict_step((images, torch.arange(3), ["", "", ""]), 0)["probs"]
        torch.testing.assert_close(probs, mirrored.softmax(dim=1))


def test_every_rank_takes_the_same_cache_on_device_decision(in_tmp, monkeypatch):
    # A rank with room would hold the cache on its GPU while another read from host memory: different
    # loaders and RNG paths. The local answer goes through the strategy's all-ranks decision.
    from flowers.data.pipelines import cached as cached_pipeline

    data = make_tree(in_tmp / "photos", {"a": 4, "b": 4}, size=80)
    asked = []

    class Strategy:
        root_device = torch.device("cuda", 0)
        others_agree = True

        def reduce_boolean_decision(self, decision, all=True):
            asked.append((decision, all))
            return decision and self.others_agree

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**12, 10**12))  # plenty on this rank
    monkeypatch.setattr(cached_pipeline, "upload_in_chunks",
                        lambda pixels, device: torch.from_numpy(np.array(pixels)))
    for others_agree in (True, False):
        strategy = Strategy()
        strategy.others_agree = others_agree
        module = FlowerDataModule(str(data), image_size=64, batch_size=4, cache=True)
        module.trainer = type("Trainer", (), {"strategy": strategy})()
        module.setup("fit")
        assert module.train_set.as_index is others_agree
    assert asked == [(True, True), (True, True)]


def test_the_cache_goes_to_the_device_a_slice_at_a_time():
    from flowers.data.cache import upload_in_chunks

    pixels = np.random.default_rng(0).integers(0, 256, (7, 3, 4, 4), dtype=np.uint8)
    slices = []

    class Recorded:  # the memory map, recording each read
        shape, dtype = pixels.shape, pixels.dtype

        def __len__(self):
            return len(pixels)

        def __getitem__(self, index):
            if isinstance(index, slice):
                slices.append(len(pixels[index]))
            return pixels[index]

    for chunk_images in (1, 3, 7, 10):
        slices.clear()
        out = upload_in_chunks(Recorded(), torch.device("cpu"), chunk_bytes=chunk_images * pixels[0].nbytes)
        assert torch.equal(out, torch.from_numpy(pixels))
        assert max(slices) == min(chunk_images, len(pixels)) and sum(slices) == len(pixels)


def test_a_cache_held_on_the_device_gives_the_same_batches(in_tmp, monkeypatch):
    # On CUDA the whole cache is uploaded once and batches carry indices; CI has no GPU, so here the
    # "device" copy is a CPU tensor: the same code path after the upload.
    from flowers.data.pipelines.cached import CachedPipeline
    from flowers.errors import ConfigError

    data = make_tree(in_tmp / "photos", {"a": 6, "b": 6}, size=80)
    on_host = FlowerDataModule(str(data), image_size=64, batch_size=4, cache=True)
    on_host.setup("fit")
    monkeypatch.setattr(CachedPipeline, "_cache_to_device",
                        lambda self, cache, trainer: torch.from_numpy(np.ascontiguousarray(cache.pixels)))
    on_device = FlowerDataModule(str(data), image_size=64, batch_size=4, cache=True)
    on_device.setup("fit")
    assert on_device.num_workers == 0 and on_device.val_set.as_index
    device_batch = next(iter(on_device.val_dataloader()))
    host_batch = next(iter(on_host.val_dataloader()))
    assert isinstance(device_batch, CachedBatch) and isinstance(host_batch, CachedBatch)
    assert device_batch.squares_or_indices.dtype == torch.int64 and device_batch.squares_or_indices.ndim == 1
    for module in (on_host, on_device):
        module.trainer = type("Trainer", (), {"training": False})()
    expected, expected_labels = on_host.on_after_batch_transfer(host_batch, 0)
    images, labels = on_device.on_after_batch_transfer(device_batch, 0)
    torch.testing.assert_close(images, expected)
    assert labels.tolist() == expected_labels.tolist()
    monkeypatch.undo()
    trainer = type("Trainer", (), {"strategy": type("Strategy", (), {"root_device": torch.device("cpu")})()})()
    asked = FlowerDataModule(str(data), cache=True, cache_on_device=True)
    asked.trainer = trainer
    with pytest.raises(ConfigError, match="cache_on_device"):
        asked.setup("fit")
    auto = FlowerDataModule(str(data), cache=True)
    auto.trainer = trainer
    auto.setup("fit")
    assert not auto.train_set.as_index  # unset on CPU: the host path
