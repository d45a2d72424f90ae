"""Client: torch.distributed.pipelining on the "collectives" backend, compared with gloo.

A model of five layers cut into two ``PipelineStage``s (rank 0: the first two layers, rank 1: the rest),
trained three steps with ``ScheduleGPipe`` and three with ``Schedule1F1B`` (4 micro-batches each, shapes
inferred at the first step: the stages exchange their metadata with ``send_object_list``), its activations
and gradients between the stages moving by ``isend``/``irecv``/``batch_isend_irecv``. The same run on gloo,
in the same job (a FileStore rendezvous), must end with the same parameters, bit for bit, and the same
losses.

    mpiexec -n 2 python tests/clients/pipeline.py      # prints "PASS pipeline", exits 0
"""

from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import collectives.torch_backend  # noqa: F401 - registers "collectives"

TIMEOUT = timedelta(seconds=60)


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def train(rank: int) -> tuple[list, list]:
    """Both schedules on the current default group; this stage's final parameters and the losses."""
    full = model()
    part = full[:2] if rank == 0 else full[2:]
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    losses: list = []
    for schedule_class in (ScheduleGPipe, Schedule1F1B):
        stage = PipelineStage(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        schedule = schedule_class(stage, n_microbatches=4, loss_fn=torch.nn.functional.mse_loss)
        for step in range(3):
            g = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            optimizer.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                mine: list = []
                schedule.step(target=y, losses=mine)
                losses.append([float(v) for v in mine])
            optimizer.step()
    return [p.detach().clone() for p in part.parameters()], losses


def main() -> int:
    world = MPI.COMM_WORLD
    if world.size != 2:
        sys.exit("pipeline.py runs at 2 ranks (two stages)")
    dist.init_process_group("collectives", timeout=TIMEOUT)
    rank = dist.get_rank()
    ours, our_losses = train(rank)
    dist.destroy_process_group()

    path = world.bcast(os.path.join(tempfile.gettempdir(), f"collectives-pipeline-{os.getpid()}") if rank == 0
                       else None, root=0)
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2, timeout=TIMEOUT)
        theirs, their_losses = train(rank)
        dist.destroy_process_group()
    finally:
        world.Barrier()
        if rank == 0 and os.path.exists(path):
            os.unlink(path)

    same = len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)) and \
        our_losses == their_losses
    moved = any(not torch.equal(a, b) for a, b in zip(ours, [p.detach() for p in (model()[:2] if rank == 0
                                                                                    else model()[2:]).parameters()]))
    verdicts = world.allgather((same, moved))
    if rank == 1:
        print(f"losses (collectives): {our_losses}")
    if all(s and m for s, m in verdicts):
        if rank == 0:
            print("PASS pipeline")
        return 0
    print(f"rank {rank}: FAIL pipeline: same as gloo {same}, parameters trained {moved}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
