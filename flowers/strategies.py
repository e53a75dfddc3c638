"""``strategy="dp"``: one process drives all of a machine's GPUs, splitting each batch across them.

Lightning 2 removed its ``DataParallelStrategy``; this one is smaller on purpose. Only the network's
forward (``FlowerClassifier.net``) runs through ``torch.nn.parallel.data_parallel``: the batch is
scattered over the GPUs, each replica runs its slice, and the logits are gathered on the first GPU,
where the loss, the metrics and the logging run once. The LightningModule is never wrapped, so its
``state_dict`` (and every checkpoint) has exactly the keys of a single-device run.

On a machine without CUDA, ``strategy=dp`` runs the plain forward in its one process (torch's
``data_parallel`` needs GPUs) and says so; ``strategy=ddp`` is the way to use several CPU processes.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.nn.parallel import data_parallel

from flowers.errors import ConfigError


class AutocastReplica(nn.Module):
    """What each dp replica runs: the network's own forward, under the caller's autocast dtype.

    ``parallel_apply`` re-enters autocast in its worker threads with the caller's *enabled* flag but
    not its dtype, so without this ``bf16-mixed`` replicas would silently compute in float16
    (pytorch issue 125186). The main thread sets ``dtype`` right before each scatter; replicas are
    shallow copies made after that, so they see it.
    """

    def __init__(self, net: nn.Module, device_type: str = "cuda") -> None:
        super().__init__()
        self.net = net
        self.device_type = device_type
        self.dtype: torch.dtype | None = None

    def capture_autocast(self) -> None:
        enabled = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type) if enabled else None

    def forward(self, *inputs: Any) -> Any:
        # The class's forward, not ``self.net.forward``: the original net's instance attribute is the
        # dispatching patch, and replicas inherit a copy of it.
        forward = type(self.net).forward.__get__(self.net)
        if self.dtype is None:
            return forward(*inputs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return forward(*inputs)


class DataParallelStrategy(ParallelStrategy):
    """Single-process data parallelism over the GPUs of one machine.

    Args:
        module_name: the LightningModule's attribute whose forward is split across the GPUs.
        device_ids: CUDA indices to scatter over, overriding ``--trainer.devices``; repeating an
            index (``[0, 0]``) exercises scatter/gather on a single GPU.
    """

    strategy_name = "dp"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io=None,
        precision_plugin=None,
        *,
        module_name: str = "net",
        device_ids: list[int] | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.module_name = module_name
        self.device_ids = list(device_ids) if device_ids else None
        self._num_nodes = 1
        self._patched: nn.Module | None = None

    # -- one process: ranks, sizes and collectives are trivial --------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # The accelerator connector sets this from --trainer.num_nodes before anything runs.
        if num_nodes > 1:
            raise ConfigError(
                f"strategy=dp runs in one process on one machine, but trainer.num_nodes={num_nodes}. "
                "Use --trainer.strategy=ddp for several machines."
            )
        self._num_nodes = num_nodes

    @property
    def root_device(self) -> torch.device:
        if self.device_ids and self.on_cuda():
            return torch.device("cuda", self.device_ids[0])
        return self.parallel_devices[0]

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        # One process sees the whole data set: no DistributedSampler.
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    def reduce(self, tensor, *args: Any, **kwargs: Any):
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj, src: int = 0):
        return obj

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def setup_environment(self) -> None:
        # Started by torchrun or srun as one of several processes, every one of them would be a rank 0
        # writing the same checkpoints.
        env = self.cluster_environment
        if env is not None and env.creates_processes_externally and env.world_size() > 1:
            raise ConfigError(
                f"strategy=dp runs as one process, but this is one of {env.world_size()} started by torchrun or "
                "srun. Use --trainer.strategy=ddp, or start a single process."
            )
        super().setup_environment()

    # -- the model -----------------------------------------------------------------------------
    def on_cuda(self) -> bool:
        return bool(self.parallel_devices) and self.parallel_devices[0].type == "cuda"

    def scatter_device_ids(self) -> list[int]:
        return self.device_ids or [device.index for device in self.parallel_devices]

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.on_cuda():
            self._patch_forward()
        else:
            rank_zero_warn(
                "strategy=dp without CUDA runs the plain forward in this one process (torch's data_parallel "
                "needs GPUs); use --trainer.strategy=ddp to train with several CPU processes."
            )

    def _patch_forward(self) -> None:
        net = getattr(self.lightning_module, self.module_name, None)
        if not isinstance(net, nn.Module):
            raise ConfigError(
                f"strategy=dp parallelises the module's {self.module_name!r} submodule, which "
                f"{type(self.lightning_module).__name__} does not have."
            )
        replica = AutocastReplica(net, device_type=self.root_device.type)
        device_ids = self.scatter_device_ids()

        def parallel_forward(*inputs: Any) -> Any:
            replica.capture_autocast()
            return data_parallel(replica, inputs, device_ids=device_ids, output_device=device_ids[0])

        # An instance attribute shadows the class's forward, so ``self.net(x)`` (hooks included) goes
        # through data_parallel while parameters, buffers and state_dict keys stay the net's own.
        net.forward = parallel_forward
        self._patched = net

    def teardown(self) -> None:
        if self._patched is not None:
            self._patched.__dict__.pop("forward", None)
            self._patched = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="one process, the batch split across the GPUs", override=True
        )


DataParallelStrategy.register_strategies(StrategyRegistry)
