"""torch.distributed.checkpoint on the backend "collectives" under mpiexec: an FSDP2 model (fully_shard)
saved with dcp.save and dcp.async_save, loaded back with dcp.load, and a full state dict broadcast from
rank 0 with set_model_state_dict(..., broadcast_from_rank0=True); the loaded parameters equal the same
script's on gloo, in the same job. Prints "PASS dcp" and exits 0.

    mpiexec -n 2 python tests/clients/dcp.py [--backend collectives]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import warnings

import torch
from _common import gloo_rendezvous  # (tests/clients is the script's directory)

warnings.filterwarnings("ignore")


def run(backend: str, root: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import collectives.torch_backend  # noqa: F401 - registers "collectives"

    dist.init_process_group(backend)
    n, rank = dist.get_world_size(), dist.get_rank()

    def make(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    full = make(0).state_dict()
    model = make(1)
    mesh = init_device_mesh("cpu", (n,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    def whole(m):  # the full parameters, on every rank
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in m.state_dict().items()}

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, {k: v.clone() for k, v in full.items()} if rank == 0 else {}, options=opts)  # (it fills the dict it is given)
    got = whole(model)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "sync"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    dcp.async_save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, "async")).result()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, "sync"))
    got = whole(model)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(root, "async"))
    got = whole(model)
    for k, v in full.items():
        assert torch.equal(got[k], v + 1.0), k
    out = torch.cat([got[k].reshape(-1) for k in sorted(got)])
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    args = ap.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    root = world.bcast(tempfile.mkdtemp(prefix="dcp-") if world.Get_rank() == 0 else None)
    results = {}
    for backend in [args.backend] if args.backend else ["collectives", "gloo"]:
        if backend == "gloo":
            os.environ.update(gloo_rendezvous(world))
        results[backend] = run(backend, os.path.join(root, backend))
        # free the process group now: FSDP's modules hold it through reference cycles, and a gloo group left
        # to the interpreter's exit has its worker threads drop tensors after Python is gone (abort, "terminate
        # called without an active exception", seen once in CI on Open MPI after PASS)
        gc.collect()
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
    if len(results) == 2:
        assert torch.equal(results["collectives"], results["gloo"])
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        print("PASS dcp", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
