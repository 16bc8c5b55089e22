"""torch.distributed setup and the DDP / FSDP2 strategies (PyTorch's own engines, configured)."""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from nemo_dflash.data.workers import HostShare

logger = logging.getLogger(__name__)


@dataclass
class DistState:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launch_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain process."""
    return (
        int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    )


# The key of the launch store's counter of process groups made in this launch (`init_process_group`).
GROUPS_KEY = "nemo_dflash.process_groups"


def init_process_group(backend: str, timeout: datetime.timedelta, device_id: Optional[torch.device] = None) -> None:
    """`torch.distributed.init_process_group` from torchrun's environment, under a store prefix no earlier group
    of this launch used. torchrun's store outlives a process group, and torch names every default group alike,
    so a second group in one launch (the pipeline's stages each make one) would read the keys the first left:
    gloo ranks connecting to a closed port, NCCL ones to an old communicator. Every rank adds once per group,
    and each group runs a collective before it is destroyed, so the ranks of one group read values in the same
    block of ``world``."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    n = (int(store.add(GROUPS_KEY, 1)) - 1) // world
    dist.init_process_group(backend, store=dist.PrefixStore(f"{GROUPS_KEY}/{n}/", store), rank=rank,
                            world_size=world, timeout=timeout, device_id=device_id)


def init_distributed(
    device: str | torch.device = "auto", backend: Optional[str] = None, timeout_minutes: int = 30
) -> DistState:
    """Join the torchrun job if there is one (WORLD_SIZE > 1); NCCL on GPU, gloo on CPU.

    `device` is a resolved device, or a setting ("auto" | "cpu" | "cuda") resolved here."""
    rank, local_rank, world = launch_env()
    dev = pick_device(device, local_rank) if isinstance(device, str) else device
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        init_process_group(backend, datetime.timedelta(minutes=timeout_minutes),
                           device_id=dev if dev.type == "cuda" else None)
    return DistState(rank=rank, local_rank=local_rank, world_size=world, device=dev)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, state: DistState) -> torch.Tensor:
    if state.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def resolve_strategy(strategy: str, world_size: int) -> str:
    """"auto" is DDP under torchrun and none for one process; DDP/FSDP2 with one process run unwrapped."""
    if strategy == "auto":
        return "ddp" if world_size > 1 else "none"
    if strategy in ("ddp", "fsdp2") and world_size <= 1:
        logger.info("distributed.strategy=%s with one process: running unwrapped", strategy)
        return "none"
    return strategy


def wrap_draft(trainer_module: nn.Module, strategy: str, state: DistState, param_dtype: Optional[torch.dtype]) -> nn.Module:
    """DDP replicates the trainer module (it holds only the draft's parameters); FSDP2 shards
    the draft per decoder layer with `param_dtype` compute and fp32 gradient reduction."""
    if strategy == "none":
        return trainer_module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [state.device.index] if state.device.type == "cuda" else None
        return DDP(trainer_module, device_ids=ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        draft = trainer_module.draft
        for layer in draft.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(draft, mp_policy=mp)
        return trainer_module
    raise ValueError(f"Unknown distributed.strategy {strategy!r}")


def shard_target_layers(layers: nn.ModuleList) -> None:
    """FSDP2-shard the frozen target's decoder layers, so a target larger than one GPU trains.

    Only the layers: the embeddings, final norm and lm_head stay whole on every rank because the
    draft uses them outside the target's forward. Each layer is gathered for its own forward
    and resharded right after, so the early stop after the last captured layer stays valid.
    """
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, reshard_after_forward=True)


__all__ = [
    "DistState",
    "GROUPS_KEY",
    "all_reduce_sum",
    "init_distributed",
    "init_process_group",
    "launch_env",
    "pick_device",
    "resolve_strategy",
    "shard_target_layers",
    "shutdown_distributed",
    "wrap_draft",
]


def host_share(state: DistState) -> Optional[HostShare]:
    """How this host's ranks share the data's preparation (`nemo_dflash.data.build_datasets`): a directory
    under the host's temp dir named by a number rank 0 draws and sends to every rank (one run's alone), and
    the job's barrier. None for one process or one rank a host."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not state.enabled or local <= 1:
        return None
    token = torch.randint(0, 2**62, (1,), dtype=torch.int64) if state.is_main else torch.zeros(1, dtype=torch.int64)
    token = token.to(state.device)
    dist.broadcast(token, src=0)
    directory = Path(tempfile.gettempdir()) / f"nemo_dflash_data_{int(token.item()):x}"
    return HostShare(rank=state.local_rank, ranks=local, directory=directory, barrier=dist.barrier)
