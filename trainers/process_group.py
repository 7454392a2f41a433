"""The process group for a weight broadcast: trainer rank 0 is its rank 0, the engines' ranks follow.

Built the way SGLang's own `init_custom_process_group` builds it (TCP rendezvous, PrefixStore,
`_new_process_group_helper`), so both sides meet in one group apart from each side's default group.
"""

from __future__ import annotations

import inspect
import socket
from datetime import timedelta
from typing import Any

from slime_dsa.weights.payloads import DEFAULT_GROUP


def init_weight_update_group(master_address: str, master_port: int, world_size: int, *, rank: int = 0,
                             group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                             timeout: timedelta = timedelta(minutes=10)) -> Any:
    """Join the group as `rank` (blocks until all `world_size` ranks joined). "nccl" on GPU; "gloo" on CPU."""
    from torch.distributed.distributed_c10d import (  # noqa: PLC0415
        Backend, PrefixStore, _new_process_group_helper, _world, rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def free_port() -> int:
    """A TCP port free on this machine now: where a rank 0 about to call init_weight_update_group can listen."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
