"""accelerate on the backend "collectives" under mpiexec: init_process_group("collectives") first, then
Accelerator(cpu=True) takes that group; a few steps of training, gather_for_metrics, save_state/load_state;
the final parameters equal the same script's on gloo, in the same job. Also run by
``accelerate launch --cpu --mpirun_hostfile`` (tests/clients/README.md), which exports MASTER_ADDR/
MASTER_PORT but not RANK: the ranks then come from MPI. Prints "PASS accelerate_cpu" and exits 0.

    mpiexec -n 2 python tests/clients/accelerate_cpu.py [--backend collectives]
"""

from __future__ import annotations

import argparse
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
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    import collectives.torch_backend  # noqa: F401 - registers "collectives"

    dist.init_process_group(backend)
    acc = Accelerator(cpu=True)
    assert acc.num_processes == dist.get_world_size() and acc.process_index == dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(48, 4)
    y = x.sum(1, keepdim=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, loader = acc.prepare(model, opt, loader)
    for xb, yb in loader:
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        opt.step()
    preds = []
    for xb, _ in loader:
        preds.append(acc.gather_for_metrics(model(xb).detach()))
    assert sum(p.shape[0] for p in preds) == len(x), [p.shape for p in preds]
    state = os.path.join(root, "state")
    acc.save_state(state)
    acc.wait_for_everyone()  # the main process writes: every rank reads it back below
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(state)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved, strict=True))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    acc.wait_for_everyone()
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    dist.destroy_process_group()
    return params


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default=None)
    args = ap.parse_args()
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    root = world.bcast(tempfile.mkdtemp(prefix="accelerate-") if world.Get_rank() == 0 else None)
    launched = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    results = {}
    for backend in [args.backend] if args.backend else ["collectives", "gloo"]:
        if backend == "gloo":  # gloo needs RANK/WORLD_SIZE and a TCP rendezvous
            os.environ.update(gloo_rendezvous(world))
        results[backend] = run(backend, os.path.join(root, backend))
        for k in ("RANK", "WORLD_SIZE"):
            os.environ.pop(k, None)
        for k, v in launched.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    if len(results) == 2:
        assert torch.allclose(results["collectives"], results["gloo"], rtol=1e-6, atol=1e-7), results
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        print("PASS accelerate_cpu", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
