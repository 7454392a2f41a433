"""The nodes of the Ray cluster this driver is on: whether the run's actors may land on another node than the
driver's, and so where its engines listen and its trainer ranks meet. Call with Ray initialised."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def nodes_taking_actors() -> list[dict[str, Any]]:
    """Ray's records of the alive nodes with CPUs or GPUs (nodes without either take no actor of the run)."""
    import ray  # noqa: PLC0415

    return [n for n in ray.nodes() if n.get("Alive")
            and any(n.get("Resources", {}).get(kind, 0) > 0 for kind in ("CPU", "GPU"))]


def other_nodes() -> list[dict[str, Any]]:
    """The nodes taking actors besides the driver's: where an actor's 127.0.0.1 is not the driver's."""
    import ray  # noqa: PLC0415

    here = ray.get_runtime_context().get_node_id()
    return [n for n in nodes_taking_actors() if n.get("NodeID") != here]


def driver_address() -> str:
    """Where the run's actors reach this driver: 127.0.0.1 when they all run on its node, else its node's address."""
    import ray  # noqa: PLC0415

    return ray.util.get_node_ip_address() if other_nodes() else LOOPBACK
