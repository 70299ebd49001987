"""Data-parallel training across processes launched by ``torchrun``: DDP, or FSDP for
drafters whose weights, gradients and AdamW state do not fit one device.

The unit of work is the **global** micro-batch (``batch_size`` sequences). Every rank draws
the same global batch and the same anchors (one seed, the same random streams on every
rank), then trains on its own slice of it (``rank::world``) and reads only that slice's
features. The loss is normalised by the weight of the whole global batch, so the averaged
gradient is the one a single process would compute: a run gives the same loss curve at any
number of ranks (to float rounding), and a checkpoint written by N ranks resumes on M.

Checkpoints hold full (unsharded) states in one file, written by rank 0; every rank reads
it on resume, so ``out`` must be on a filesystem all ranks see. Only rank 0 writes logs,
plots and the export, and only it evaluates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from vllm_dflash.errors import DFlashConfigError

T = TypeVar("T")
Parallel = Literal["ddp", "fsdp"]


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def slice(self, items: Sequence[T]) -> list[T]:
        """This rank's share of a global batch."""
        return list(items[self.rank :: self.world])


def from_env() -> Ranks:
    """The ranks ``torchrun`` describes in the environment; one process without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend)
    return Ranks(rank, world, local)


def device(ranks: Ranks) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", ranks.local_rank)
    return torch.device("cpu")


def check_batch(batch_size: int, ranks: Ranks) -> None:
    if batch_size % ranks.world:
        raise DFlashConfigError(
            f"field 'batch_size' = {batch_size} (sequences per global micro-batch) does not "
            f"split over {ranks.world} ranks. Fix: a multiple of {ranks.world}, or another "
            "--nproc-per-node"
        )


def wrap(model: nn.Module, ranks: Ranks, parallel: Parallel) -> nn.Module:
    """The module the training step calls: ``model`` itself on one rank, else DDP around it
    or ``model`` sharded in place by FSDP (one unit: the drafter's layers share the context
    projection, so the whole drafter is gathered for each forward and backward, while its
    gradients and optimizer state stay sharded)."""
    if ranks.world == 1:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    ids = [ranks.local_rank] if torch.cuda.is_available() else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_sum(t: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """``t`` summed over ranks (a new tensor; ``t`` itself on one rank)."""
    if ranks.world == 1:
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def full_states(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer states on the CPU, keyed by parameter name, whatever
    the wrapping (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, opt, options=opts)


def load_full_states(
    model: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        opt,
        model_state_dict=model_state,
        optim_state_dict=opt_state,
        options=StateDictOptions(full_state_dict=True),
    )


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def close(ranks: Ranks) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
