"""The Ray cluster a run uses: a local one started or a running one joined (cluster.address), whether it fits the
run's actors, its nodes (where engines listen, which directories every node must see), and the actors still waiting
for Ray to place them."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from slime_dsa import interrupts
from slime_dsa.config import RecipeConfig

logger = logging.getLogger(__name__)

OFFLINE_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}


def init_ray(recipe: RecipeConfig) -> None:
    """Local cluster by default; cluster.address joins an existing one.

    A local cluster takes commands only with its token (Ray's token authentication, on by default in Ray 2.60):
    Ray 2.60 cannot be bound to 127.0.0.1 (ray.init turns a loopback node address into the machine's address, and
    its GCS and raylet listen on every interface), so the token is what keeps other hosts, and processes without
    the user's ~/.ray/auth_token, from driving it. RAY_AUTH_MODE=disabled turns it off: warned.
    """
    import ray  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if ray.is_initialized():
        return
    address = recipe.cluster.address
    kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": {"env_vars": OFFLINE_ENV}}
    if address is None:
        # Logical CPUs: a small model's actors mostly wait on each other, so let more of them share the cores.
        kwargs["num_cpus"] = max(os.cpu_count() or 1, _actors_needed(recipe))
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            logger.warning("RAY_AUTH_MODE=disabled: the local Ray cluster's ports, open on every interface, take "
                           "commands from any host that reaches this machine")
    else:
        _check_reachable(address)
        _send_ray_token_when_joining()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        if address is None:
            raise
        raise _join_error(address, e) from None
    except ValueError as e:
        if address is None or "ray[client]" not in str(e):
            raise
        raise UserError(f"cluster.address: {address} needs Ray Client, which this install lacks: pip install "
                        "'ray[client]', or give the cluster's GCS address (host:port, as `ray start` printed)"
                        ) from None
    if previous is interrupts.terminate and threading.current_thread() is threading.main_thread():
        # ray.init replaces the CLI's SIGTERM handler (and its core worker then aborts the driver with a C stack
        # dump): put it back, so that a scheduler's stop takes Ctrl-C's path (slime_dsa/interrupts.py).
        signal.signal(signal.SIGTERM, previous)


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """UserError (one line) when nothing answers at a host:port cluster.address: ray.init would retry it for
    minutes, printing only Ray's connection warnings. `auto` and ray:// addresses are left to ray.init."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(f"cluster.address: nothing answers at {address} ({e.strerror or type(e).__name__}): "
                        "start the cluster there (ray start --head) or correct the address") from None


def _send_ray_token_when_joining() -> None:
    """RAY_AUTH_MODE=token when it is unset and a Ray token is at hand, as `ray start` does: ray.init turns token
    authentication on only for a cluster it starts, and a `ray start --head` cluster refuses a driver without it."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config  # noqa: PLC0415

        Config.initialize("")  # Ray read RAY_AUTH_MODE when imported: as `ray start` does, read it again


def _join_error(address: str, error: BaseException) -> Exception:
    """The UserError (one line, naming cluster.address) for a Ray cluster that could not be joined."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    chain, cause = [], error
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    if any("InvalidAuthToken" in text or "Authentication token" in text for text in chain):
        why = ("it refused this driver's Ray token: put the cluster's token (~/.ray/auth_token on its head node) in "
               "~/.ray/auth_token or $RAY_AUTH_TOKEN here")
    else:
        first = chain[0].splitlines()[0] if chain[0] else type(error).__name__
        why = f"{first}: check the address and that the cluster is up"
    return UserError(f"cluster.address: cannot join the Ray cluster at {address!r}: {why}")


def gpu_keys(recipe: RecipeConfig) -> list[str]:
    """The recipe's per-actor GPU keys above 0 for actors the run starts, as 'key (value)'."""
    cl, cr = recipe.cluster, recipe.critic
    starts_engines = recipe.rollout.engine != "external" or any(t.serving != "external" for t in recipe.teachers)
    keys = {"cluster.num_gpus_per_engine": cl.num_gpus_per_engine if starts_engines else 0.0,
            "cluster.num_gpus_per_trainer": cl.num_gpus_per_trainer,
            "critic.num_gpus_per_worker": cr.num_gpus_per_worker if cr.placement == "separate" else 0.0}
    return [f"{key} ({value})" for key, value in keys.items() if value > 0]


def check_local_gpus(recipe: RecipeConfig) -> None:
    """UserError (one line) when a local Ray cluster, which has this machine's GPUs and no more, could not place
    the actors that ask for GPUs: Ray would wait for them for ever."""
    import torch  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    asking = gpu_keys(recipe)
    if recipe.cluster.address is None and asking and torch.cuda.device_count() == 0:
        raise UserError(f"{asking[0]} asks for GPUs, but this machine has no GPU for the local Ray cluster: run "
                        "it on a GPU machine, or join a cluster that has them (cluster.address)")


def engine_host(recipe: RecipeConfig) -> str:
    """Where the engines the run starts listen: on a joined cluster each engine's node address (the run's key is
    required there, as everywhere), since nodes may join it while the run goes on and take a replacement; else
    127.0.0.1 (a local cluster is this machine)."""
    from rollout.actors import NODE_ADDRESS  # noqa: PLC0415

    return NODE_ADDRESS if recipe.cluster.address is not None else "127.0.0.1"


def _alive_nodes() -> list[dict[str, Any]]:
    """Ray's records of the cluster's alive nodes."""
    import ray  # noqa: PLC0415

    return [n for n in ray.nodes() if n.get("Alive")]


def _other_nodes() -> list[dict[str, Any]]:
    """The alive nodes besides the driver's with CPUs or GPUs: where an actor's 127.0.0.1 is not the driver's (nodes
    without either take no actor of the run)."""
    import ray  # noqa: PLC0415

    here = ray.get_runtime_context().get_node_id()
    return [n for n in _alive_nodes() if n.get("NodeID") != here
            and any(n.get("Resources", {}).get(kind, 0) > 0 for kind in ("CPU", "GPU"))]


def check_nodes_share_paths(recipe: RecipeConfig, model_dir: Path, run_dir: Path, checkpoint_dir: Path,
                            timeout_s: float = 120.0) -> None:
    """UserError (one line) naming the first node besides the driver's that does not see the model directory (the
    critic's and the teachers' our engines serve too), the run directory or the checkpoint directory where the driver
    does: engines and ranks load the models, and write checkpoints and logs, at the driver's paths, so a run across
    nodes needs a filesystem they share."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    nodes = _other_nodes()
    if not nodes:
        return
    # A file only the driver just wrote: a node that sees it sees the driver's directory, not a same-named local one
    markers = [Path(d) / f".node-check-{secrets.token_hex(8)}" for d in (run_dir, checkpoint_dir)]
    for marker in markers:
        marker.write_text("")
    try:
        probe = ray.remote(num_cpus=0)(_missing_paths)
        models = _model_dirs(recipe, model_dir)
        wanted = [*map(str, markers), *models]
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(wanted) for n in nodes]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [n.get("NodeManagerAddress") for n, ref in zip(nodes, refs) if ref in pending]
            raise UserError(f"cluster.address: node {late[0]} of the Ray cluster did not run the check that it sees "
                            f"the run's directories within {timeout_s:g} s (of {len(late)} such node(s)): is it up "
                            "and reachable?")
        found = ray.get(refs)
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)
    names = {wanted[0]: f"the run directory {run_dir}", wanted[1]: f"the checkpoint directory {checkpoint_dir}",
             **models}
    for node, missing in zip(nodes, found):
        if missing:
            raise UserError(f"cluster.address: node {node.get('NodeManagerAddress')} of the Ray cluster does not see "
                            f"{names[missing[0]]}: a run across nodes needs the model, run and checkpoint directories "
                            "at the same paths on every node (a shared filesystem)")
    logger.info("the run may place actors on %d node(s) besides this driver's: engines listen on their node's "
                "address, trainer ranks meet at this driver's", len(nodes))


def _model_dirs(recipe: RecipeConfig, model_dir: Path) -> dict[str, str]:
    """{config.json path: what names it} of every model directory the run's actors load and the driver sees: the
    policy's, critic.path and the teachers our engines serve (not external ones)."""
    dirs = {Path(model_dir): f"model.path's {model_dir}"}
    if recipe.critic.path is not None:
        dirs[Path(recipe.critic.path)] = f"critic.path's {recipe.critic.path}"
    for t in recipe.teachers:
        if t.serving != "external":
            dirs[Path(t.path)] = f"teacher '{t.name}''s path {t.path}"
    return {str(d / "config.json"): name for d, name in dirs.items() if (d / "config.json").exists()}


def _missing_paths(paths: list[str]) -> list[str]:
    """The paths that do not exist on this node (a Ray task's)."""
    return [p for p in paths if not os.path.exists(p)]


def check_cluster_fits(recipe: RecipeConfig) -> None:
    """UserError (one line) when a joined Ray cluster has, in all or on its largest node, fewer CPUs or GPUs than
    the run's actors ask for: Ray would wait for them for ever, silently. Resources held by other jobs are not
    counted against it (they may be freed)."""
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    if recipe.cluster.address is None:
        return
    nodes = [n.get("Resources", {}) for n in _alive_nodes()]
    cl, cr, actors = recipe.cluster, recipe.critic, _actor_count(recipe)
    asks = [("CPU", "cluster.num_cpus_per_actor", cl.num_cpus_per_actor, actors * cl.num_cpus_per_actor)]
    engines, critics = _policy_engines(recipe), _separate_critics(recipe)
    asks += [("GPU", "cluster.num_gpus_per_engine", cl.num_gpus_per_engine, engines * cl.num_gpus_per_engine),
             ("GPU", "cluster.num_gpus_per_trainer", cl.num_gpus_per_trainer,
              recipe.trainer.num_workers * cl.num_gpus_per_trainer),
             ("GPU", "critic.num_gpus_per_worker", cr.num_gpus_per_worker, critics * cr.num_gpus_per_worker)]
    for kind, key, each, wanted in asks:
        largest = max((n.get(kind, 0.0) for n in nodes), default=0.0)
        if wanted > 0 and each > largest:
            raise UserError(f"{key}: each actor asks for {each:g} {kind}s, but no node of the Ray cluster at "
                            f"{cl.address} has that many (the largest has {largest:g}): Ray would wait for ever")
    for kind in ("CPU", "GPU"):
        total, keys = sum(n.get(kind, 0.0) for n in nodes), [a for a in asks if a[0] == kind and a[3] > 0]
        wanted = sum(a[3] for a in keys)
        if wanted > total + 1e-6:
            raise UserError(f"{keys[0][1]}: the run's {actors} actors ask for {wanted:g} {kind}s in all, but the Ray "
                            f"cluster at {cl.address} has {total:g}: Ray would wait for ever; lower it or add nodes")


def warn_unplaced(recipe: RecipeConfig) -> None:
    """One warning when some of the run's actors still wait for Ray to place them: Ray waits silently for resources
    that other jobs hold."""
    waiting = _unplaced_actors()
    if waiting:
        logger.warning("%s", _unplaced_line(recipe, waiting))


def stop_unplaced(recipe: RecipeConfig) -> str:
    """At an interruption during start-up: kill the run's actors that Ray has not placed yet, so that the start-up
    threads waiting on them in ray.get end (else Ctrl-C hangs: asyncio and Python's exit wait for those threads).
    Returns the line naming what the run waited for, or '' when nothing waited."""
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        return ""
    waiting = _unplaced_actors()
    if not waiting:
        return ""
    line = _unplaced_line(recipe, waiting, interrupted=True)
    for actor_id in waiting:  # ray.kill takes handles, which the start-up threads hold: kill by id, as ray.kill does
        ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
    return line


def _unplaced_actors() -> dict[str, dict]:
    """{actor id: Ray's actor info} of this job's actors that wait for Ray to place them."""
    import ray  # noqa: PLC0415

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return {i: a for i, a in ray._private.state.actors(job_id=job).items()
            if a.get("State") in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")}


def _unplaced_line(recipe: RecipeConfig, waiting: dict[str, dict], interrupted: bool = False) -> str:
    """One line: how many of the run's actors wait (of which classes), what each asks for, what the cluster has free."""
    import ray  # noqa: PLC0415

    free = ray.available_resources()
    ask = f"{recipe.cluster.num_cpus_per_actor:g} CPU each, cluster.num_cpus_per_actor, and their GPUs"
    where = (f"the cluster has {free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs free now; other jobs "
             "hold the rest")
    if not interrupted:
        return f"{len(waiting)} of the run's actors wait for Ray to place them ({ask}): {where}"
    names = sorted({a.get("ActorClassName", "?").rpartition(".")[2] for a in waiting.values()})
    return f"while waiting for Ray to place {len(waiting)} of the run's actors ({', '.join(names)}; {ask}): {where}"


def _policy_engines(recipe: RecipeConfig) -> int:
    """Rollout engines the run starts (none for external servers)."""
    return recipe.rollout.num_engines if recipe.rollout.engine != "external" else 0


def _separate_critics(recipe: RecipeConfig) -> int:
    """Critic workers of their own (placement separate)."""
    return recipe.critic.num_workers if recipe.critic.placement == "separate" else 0


def _actor_count(recipe: RecipeConfig) -> int:
    """Engines, trainer and critic workers and teacher engines the run starts as Ray actors."""
    teachers = sum(t.num_engines for t in recipe.teachers if t.serving in ("embedded", "sglang"))
    teachers += len({t.swap_group for t in recipe.teachers if t.serving == "swap"})
    return _policy_engines(recipe) + recipe.trainer.num_workers + _separate_critics(recipe) + teachers


def _actors_needed(recipe: RecipeConfig) -> int:
    return int(_actor_count(recipe) * recipe.cluster.num_cpus_per_actor) + 1
