"""What an RL run needs before its first step, besides its run directory (slime_dsa/run_dir.py) and its Ray cluster
(cluster.py): the engines, their access and capacity, and the actors' cores."""

from __future__ import annotations

import logging
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_dsa.config import RecipeConfig

logger = logging.getLogger(__name__)

API_KEY_ENV = "SLIME_DSA_API_KEY"  # external engines' key (the one their `serve --api-key` was given)


@dataclass(frozen=True)
class EngineAccess:
    """What the run's engines require of a caller: the API key (a fresh one per run for the engines the run starts,
    so no other local process or web page can drive them) and the directories they may load weights from."""

    api_key: str | None
    weight_dirs: tuple[str, ...] = ()
    host: str = "127.0.0.1"  # where the engines the run starts listen (engine_host)

    @classmethod
    def for_run(cls, recipe: RecipeConfig, weight_dirs: list[str], host: str = "127.0.0.1") -> EngineAccess:
        """A new key for engines the run starts; $SLIME_DSA_API_KEY (or none) for external ones."""
        if recipe.rollout.engine == "external":
            return cls(os.environ.get(API_KEY_ENV) or None)
        return cls(secrets.token_urlsafe(32), tuple(weight_dirs), host)


async def check_external_engines(urls: list[str], api_key: str | None, timeout_s: float = 10.0) -> None:
    """UserError (one line) when an external engine refuses the run's key (401 or 403 on /get_model_info): every
    request of the run would fail, and it would skip every step. An engine not reachable yet is left to the run."""
    import asyncio  # noqa: PLC0415

    import aiohttp  # noqa: PLC0415

    from rollout.client import EngineClient, EngineRequestError  # noqa: PLC0415
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    async with EngineClient(urls, api_key=api_key) as client:
        for i, url in enumerate(urls):
            try:
                await client.get(url, "/get_model_info", timeout_s=timeout_s)
            except EngineRequestError as e:
                if e.status in (401, 403):
                    given = f"the key in ${API_KEY_ENV}" if api_key else f"no key (${API_KEY_ENV} is not set)"
                    raise UserError(f"rollout.engine_urls[{i}]: {url} refused {given} ({e.status}: {e.message}); set "
                                    f"${API_KEY_ENV} to the key the server was started with") from None
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning("external engine %s not reachable yet (%s): the run retries it", url, e)


def engine_capacity(recipe: RecipeConfig, use_async: bool) -> tuple[int, int]:
    """(max_cache_tokens, max_running_requests) of each embedded engine: room for every rollout the loop can
    have in flight at once, so that none waits in an engine's queue while the trainer waits for it.

    Groups in flight over all engines: one step's largest round (x max_oversample_factor with dynamic sampling) in
    the synchronous loop; in the asynchronous one the StalenessGate lets (max_staleness + 1) steps' groups be started and not yet
    trained. Samples in flight are capped by max_concurrency (rollout.limiter.SampleLimiter). A group's samples stay on
    one engine (session routing), so each engine takes ceil(groups / num_engines) groups. Each request reserves
    its prompt + response rows rounded up to whole cache blocks. rollout.max_cache_tokens, when set, replaces the
    derived token budget. Evaluation prompts are not counted (they queue behind the rollouts when the cache is
    full); the running-request cap never goes below the engine's default, for them.
    """
    from rollout.engine.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_RUNNING_REQUESTS  # noqa: PLC0415

    ro = recipe.rollout
    groups = recipe.in_flight_samples(use_async) // ro.n_samples_per_prompt
    per_engine = -(-groups // ro.num_engines) * ro.n_samples_per_prompt
    requests = max(1, min(per_engine, -(-recipe.max_concurrency(use_async) // ro.num_engines)))
    rows = recipe.data.max_prompt_length + ro.max_response_length - 1  # the last token is never fed back
    per_request = -(-rows // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
    return ro.max_cache_tokens or max(requests * per_request, 4096), max(requests, DEFAULT_MAX_RUNNING_REQUESTS)


def start_engines(recipe: RecipeConfig, model_dir: Path, use_async: bool = False,
                  access: EngineAccess | None = None, log_dir: Path | None = None) -> tuple[list[str], list[Any]]:
    """(URLs, actor handles) of the rollout engines; external engines have no actors. `use_async`: the
    asynchronous loop will drive them (more rollouts in flight: see engine_capacity). `access`: the key they
    require and the directories they may load weights from. `log_dir`: each engine logs to engine_<i>.log there."""
    from rollout.actors import start_engine_actors  # noqa: PLC0415

    ro = recipe.rollout
    if ro.engine == "external":
        return list(ro.engine_urls), []
    actors = create_engines(recipe, model_dir, use_async, access, ro.num_engines, log_dir)
    urls = start_engine_actors(actors)
    logger.info("%d %s engine(s) up: %s%s", len(urls), ro.engine, ", ".join(urls),
                f" (their logs: {Path(log_dir) / 'engine_<i>.log'})" if log_dir is not None else "")
    return urls, actors


def create_engines(recipe: RecipeConfig, model_dir: Path, use_async: bool, access: EngineAccess | None,
                   count: int, log_dir: Path | None = None, first: int = 0) -> list[Any]:
    """`count` engine actors as the recipe asks (not started): at the run's start, and to replace a lost one.
    log_dir: engine i (from `first` on) logs to log_dir/engine_<i>.log (on its node: a shared filesystem brings
    remote engines' logs to the run directory)."""
    from rollout.actors import create_engine_actors  # noqa: PLC0415
    from rollout.engine.defaults import RL_CONTINUOUS_DECODE_STEPS  # noqa: PLC0415

    ro, cl = recipe.rollout, recipe.cluster
    access = access or EngineAccess(None)
    logs = None if log_dir is None else [str(Path(log_dir) / f"engine_{i}.log") for i in range(first, first + count)]
    if ro.engine == "sglang":
        return create_engine_actors(count, kind="sglang", num_gpus_per_engine=cl.num_gpus_per_engine,
                                    num_cpus_per_engine=cl.num_cpus_per_actor, log_files=logs, host=access.host,
                                    sglang_config=sglang_config(recipe, model_dir, ro.return_indexer_topk,
                                                                cl.placement == "colocated", access.api_key))
    dtype = None if recipe.model.dtype == "auto" else recipe.model.dtype
    max_tokens, max_requests = engine_capacity(recipe, use_async)
    logger.info("each engine: KV cache of %d tokens, up to %d running requests", max_tokens, max_requests)
    return create_engine_actors(
        count, kind="embedded", num_gpus_per_engine=cl.num_gpus_per_engine,
        num_cpus_per_engine=cl.num_cpus_per_actor, log_files=logs, host=access.host, model_dir=str(model_dir),
        engine_kwargs={"dtype": dtype, "max_cache_tokens": max_tokens, "max_running_requests": max_requests,
                       "ops_backend": recipe.model.ops_backend, "keep_indexer_topk": ro.return_indexer_topk,
                       "true_on_policy": recipe.model.true_on_policy, "overlap": ro.overlap_schedule is not False,
                       "index_key_cache_dtype": ro.index_key_cache_dtype,
                       "num_continuous_decode_steps": ro.num_continuous_decode_steps or RL_CONTINUOUS_DECODE_STEPS,
                       "enable_torch_compile": ro.enable_torch_compile,
                       "tokenizer_path": recipe.model.tokenizer_path,
                       "warmup_max_len": recipe.data.max_prompt_length + ro.max_response_length},
        server_kwargs={"api_key": access.api_key, "weight_dirs": list(access.weight_dirs)},
    )


def sglang_config(recipe: RecipeConfig, model_dir: Path | str, return_indexer_topk: bool = False,
                  memory_saver: bool = False, api_key: str | None = None) -> Any:
    """The SGLangConfig of a server launched for the run (rollout.sglang's settings) that serves `model_dir`."""
    from rollout.sglang.config import SGLangConfig  # noqa: PLC0415

    sg = recipe.rollout.sglang
    return SGLangConfig(model_path=str(model_dir), tokenizer_path=recipe.model.tokenizer_path, tp=sg.tp,
                        mem_fraction_static=sg.mem_fraction_static,
                        kv_cache_dtype=sg.kv_cache_dtype, attention_backend=sg.attention_backend,
                        enable_return_indexer_topk=return_indexer_topk, extra_args=list(sg.extra_args),
                        enable_memory_saver=memory_saver, api_key=api_key)


def actor_cores(cores: list[int], num_actors: int, cores_per_actor: float) -> list[list[int]] | None:
    """Disjoint runs of ceil(cores_per_actor) of `cores` for each of `num_actors` actors, or None if too few."""
    k = max(1, math.ceil(cores_per_actor))
    if num_actors < 1 or len(cores) < num_actors * k:
        return None
    return [cores[i * k:(i + 1) * k] for i in range(num_actors)]


def pin_actors(recipe: RecipeConfig, engine_actors: list[Any], trainer_workers: list[Any], use_async: bool) -> bool:
    """Pin every embedded engine and trainer worker to cores of its own (cluster.pin_cpus); True if done.

    Why: in the asynchronous loop the engine generates while the trainer trains; left free, the OS scheduler
    often runs both on one core (and moves them) on a busy machine, and the trainer, which the loop waits on,
    loses its core. The synchronous loop runs them in turns, so each is better off free to use any core.
    """
    import ray  # noqa: PLC0415

    cl = recipe.cluster
    on_cpu = cl.num_gpus_per_engine == 0 and cl.num_gpus_per_trainer == 0
    if cl.pin_cpus == "off" or (cl.pin_cpus == "auto" and not (use_async and on_cpu)):
        return False
    if cl.address is not None or not hasattr(os, "sched_setaffinity"):
        logger.info("cluster.pin_cpus: actors are not pinned (only on a local Ray cluster on Linux)")
        return False
    actors = list(engine_actors) + list(trainer_workers)
    cores = sorted(os.sched_getaffinity(0))
    plan = actor_cores(cores, len(actors), cl.num_cpus_per_actor)
    if plan is None:
        logger.info("cluster.pin_cpus: %d actors need %s cores each, the machine has %d: not pinned", len(actors),
                    cl.num_cpus_per_actor, len(cores))
        return False
    ray.get([actor.__ray_call__.remote(_pin_process, chosen) for actor, chosen in zip(actors, plan)])
    logger.info("pinned %d engine(s) and %d trainer worker(s) to cores %s", len(engine_actors), len(trainer_workers),
                plan)
    return True


def _pin_process(_actor: Any, cores: list[int]) -> None:
    """Inside an actor: every thread of its process onto `cores` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
