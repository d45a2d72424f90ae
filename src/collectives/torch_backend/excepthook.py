"""The exception hook that :func:`~collectives.torch_backend.register` installs: after the traceback of
Lightning's ``IndexError`` of a rank without a device it names the ``Trainer`` arguments that fit the MPI
job, and ends the job (the other ranks wait for this one)."""

from __future__ import annotations

import sys

def _lightning_devices_hint(exc: BaseException) -> str | None:
    """What to do when ``exc`` is Lightning's ``IndexError`` of a rank without a device: the ranks the MPI
    launcher started outnumber ``devices * num_nodes`` of the ``Trainer`` (its default ``devices`` on CPU
    is 1), so a rank with local rank >= ``devices`` finds no device in Lightning's ``root_device``. None
    for any other exception."""
    if not isinstance(exc, IndexError):
        return None
    tb, strategy = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "root_device" and "lightning" in code.co_filename:
            strategy = tb.tb_frame.f_locals.get("self")
        tb = tb.tb_next
    try:
        devices = len(strategy.parallel_devices)  # type: ignore[union-attr]
        nodes, local = strategy.num_nodes, strategy.local_rank  # type: ignore[union-attr]
        ranks = strategy.cluster_environment.world_size()  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - not the frame of a strategy as we know it
        return None
    if local < devices:
        return None
    fix = f"Trainer(devices={ranks // nodes}, num_nodes={nodes})" if ranks % nodes == 0 else \
        "Trainer(devices=<ranks on each machine>, num_nodes=<machines>)"
    return (f"collectives: Lightning's Trainer has devices={devices} and num_nodes={nodes} ({devices * nodes} "
            f"process{'es' if devices * nodes > 1 else ''} in all; on CPU, devices defaults to 1), but the launcher "
            f"started {ranks} ranks, and this one, local rank {local} on its machine, has no device: that is "
            f"the IndexError above. Under mpiexec or srun every rank is one device: pass devices = the ranks on "
            f"each machine and num_nodes = the machines, so that devices * num_nodes is the number of ranks: "
            f"here {fix}\n")


def _explaining(previous):
    """``sys.excepthook`` that adds :func:`_lightning_devices_hint` after ``previous`` has printed the
    traceback, then ends the MPI job (``_failure.abort_job``: rank 0 waits in torch's rendezvous for the
    ranks that died); installed by :func:`register`; any other exception is left to ``previous`` alone."""

    def hook(kind, exc, tb):
        previous(kind, exc, tb)
        try:
            hint = _lightning_devices_hint(exc)
            if hint:
                sys.stderr.write(hint)
                sys.stderr.flush()
                from .. import _failure

                if not _failure.installed():  # the other ranks wait for this one (rank 0 in torch's
                    _failure.abort_job("a rank without a Lightning device")  # rendezvous): end them too
        except Exception:  # noqa: BLE001 - an exception hook must not raise
            pass

    hook._collectives_lightning = True  # type: ignore[attr-defined]
    return hook

