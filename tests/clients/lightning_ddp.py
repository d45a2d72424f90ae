"""Lightning's DDPStrategy on the backend "collectives" under mpiexec: fit with epoch-level validation
(sync_dist=True), a checkpoint, validate(ckpt_path=...); the final parameters equal the same script's on
gloo, run in the same job (--compare). Usage (2 ranks):

    mpiexec -n 2 python tests/clients/lightning_ddp.py [--nodes] [--backend collectives|gloo] [--default-devices]

--nodes: the multi-node form (devices=1, num_nodes=N). Lightning's MPIEnvironment takes the global rank
and size from MPI and the local rank from the ranks sharing a host name, so on one machine every rank but
the first would have local rank > 0 with one device per node; the script simulates N nodes with an
MPIEnvironment whose node is the rank (local rank 0), what N real nodes of one rank each would report.
Prints "PASS lightning_ddp[...]" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import torch
from _common import gloo_rendezvous  # (tests/clients is the script's directory)

warnings.filterwarnings("ignore")


def run(backend: str, nodes: bool, root: str, default_devices: bool = False):
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from mpi4py import MPI

    import collectives.torch_backend  # noqa: F401 - registers "collectives"

    n = MPI.COMM_WORLD.Get_size()
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    y = x @ torch.arange(5.0).reshape(5, 1)
    data = torch.utils.data.TensorDataset(x, y)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = torch.nn.Linear(5, 1)

        def training_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, _):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self.log("val_loss", loss, sync_dist=True)  # epoch-level: AVG of an int64 count too

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    plugins = []
    if nodes:
        from lightning.pytorch.plugins.environments import MPIEnvironment

        class OneRankPerNode(MPIEnvironment):  # one machine playing N nodes (see the module)
            def local_rank(self) -> int:
                return 0

            def node_rank(self) -> int:
                return self.global_rank()

        plugins.append(OneRankPerNode())
    model = Model()
    # --default-devices: Lightning's default devices ("auto": 1 on CPU), a mistake under mpiexec -n N > 1
    placement = {} if default_devices else {"devices": 1 if nodes else n, "num_nodes": n if nodes else 1}
    trainer = pl.Trainer(plugins=plugins, accelerator="cpu", **placement,
        strategy=DDPStrategy(process_group_backend=backend), max_epochs=2, default_root_dir=root,
        enable_progress_bar=False, enable_model_summary=False, logger=False, deterministic=True)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    trainer.fit(model, loader, loader)
    assert trainer.world_size == n and trainer.global_rank == MPI.COMM_WORLD.Get_rank(), trainer.global_rank
    ckpt = trainer.checkpoint_callback.best_model_path
    [metrics] = trainer.validate(model, loader, ckpt_path=ckpt, verbose=False)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    import torch.distributed as dist

    dist.destroy_process_group()
    return params, metrics["val_loss"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", action="store_true")
    ap.add_argument("--backend", default=None, help="one backend only (default: collectives, then gloo)")
    ap.add_argument("--default-devices", action="store_true",
                    help="leave Trainer's devices at its default: at N > 1 ranks the job must fail, with our "
                         "explanation after Lightning's IndexError (tests/crash)")
    args = ap.parse_args()
    from mpi4py import MPI

    if args.default_devices:
        run("collectives", False, tempfile.mkdtemp(prefix="lightning-"), default_devices=True)
        return 0

    world = MPI.COMM_WORLD
    root = world.bcast(tempfile.mkdtemp(prefix="lightning-") if world.Get_rank() == 0 else None)
    results = {}
    for backend in [args.backend] if args.backend else ["collectives", "gloo"]:
        if backend == "gloo":  # gloo needs a TCP rendezvous: a port from rank 0 (Lightning sets the ranks)
            os.environ.update(gloo_rendezvous(world, ranks=False))
        results[backend] = run(backend, args.nodes, os.path.join(root, backend))
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
    if len(results) == 2:
        (p, v), (q, w) = results["collectives"], results["gloo"]
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), (p, q)
        assert abs(v - w) <= 1e-6 * max(1.0, abs(w)), (v, w)
    world.Barrier()
    if world.Get_rank() == 0:
        __import__("shutil").rmtree(root, ignore_errors=True)
        print(f"PASS lightning_ddp[{'nodes' if args.nodes else 'devices'}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
