"""Where a trainer group's ranks meet in torch's default process group: at a TCP store that rank 0 hosts (ranks built
in one place, as tests build them), or at one the process that built the group hosts (RayTrainerGroup: its address
is known before Ray places rank 0, which may land on another node)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

STORE_TIMEOUT = timedelta(minutes=30)  # torch's default for a process group: ranks Ray places late still meet


def host_store(address: str) -> tuple[dist.TCPStore, int]:
    """A TCP store in this process, on a free port of every interface: (the store, its port). Keep the store alive
    as long as the group: its ranks use it for every group they create."""
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    return store, store.port


def join_default_group(rank: int, world_size: int, address: str, port: int, device: torch.device,
                       store_hosted: bool = False) -> None:
    """Join the default process group at address:port, over NCCL when `device` is a GPU, else gloo; store_hosted:
    the group's builder hosts the store there (host_store), else rank 0 does. MASTER_ADDR and MASTER_PORT are set for
    libraries that read them."""
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
    if dist.is_initialized():
        return
    on_gpu = device.type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    # Binding the group to this rank's GPU stops torch guessing it from the global rank, which is wrong whenever
    # Ray hands a rank a GPU whose index differs from the rank.
    bound = {"device_id": _indexed(device)} if on_gpu else {}
    if not store_hosted:
        dist.init_process_group(backend, rank=rank, world_size=world_size, **bound)
        return
    store = dist.TCPStore(address, port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=STORE_TIMEOUT, **bound)


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" means the current GPU."""
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())
