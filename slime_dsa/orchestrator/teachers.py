"""The teachers of a run (on-policy distillation): their tokenizers checked against the student's, their engines
started as the recipe's teachers list says (engines of their own, SGLang servers, external servers, or a shared
engine per swap group with every member preloaded in pinned memory), the TeacherPool over them, and the restart of
an engine that dies mid-run (rollout/teachers retries its samples once the replacement answers)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout.server.defaults import API_KEY_ENV
from slime_dsa.config import RecipeConfig
from slime_dsa.config.errors import UserError
from slime_dsa.config.teachers import TeacherConfig

logger = logging.getLogger(__name__)

SCORING_CACHE_TOKENS = 1024  # prefill-only scoring takes no KV cache; this only serves /health_generate


def check_tokenizers(teachers: list[TeacherConfig], student_tokenizer: Any, student_logits: int | None = None) -> None:
    """UserError (one line, naming the teacher) when a teacher's tokenizer differs from the student's, or its model
    has another number of logits than the student's (`student_logits`; None: at least one per token)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from slime_dsa.run_dir import tokenizer_size  # noqa: PLC0415

    student_vocab = student_tokenizer.get_vocab()
    for teacher in teachers:
        where = f"teacher '{teacher.name}' ({teacher.path})"
        try:
            theirs = AutoTokenizer.from_pretrained(teacher.path)
        except (OSError, ValueError) as e:
            raise UserError(f"{where}: no tokenizer could be loaded: {e}") from None
        problem = _tokenizer_difference(student_vocab, student_tokenizer, theirs)
        if problem:
            raise UserError(f"{where}: its tokenizer differs from the student's ({problem}); on-policy distillation "
                            "scores the student's token ids, so the tokenizers must be the same")
        vocab = model_logits(Path(teacher.path))
        if vocab is None:
            continue
        if student_logits is not None and vocab != student_logits:
            raise UserError(f"{where}: its model has {vocab} logits against the student's {student_logits}; its "
                            "log-probs and top-k ids must range over the student's vocabulary")
        if vocab < (tokens := tokenizer_size(student_tokenizer)):  # highest id + 1: ids may have holes
            raise UserError(f"{where}: its model has {vocab} logits, fewer than the tokenizer's {tokens} tokens")


def model_logits(model_dir: Path) -> int | None:
    """vocab_size of an HF directory's config.json (any architecture), or None when it has none."""
    try:
        vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return vocab if isinstance(vocab, int) else None


def _tokenizer_difference(student_vocab: dict[str, int], student: Any, teacher: Any) -> str | None:
    vocab = teacher.get_vocab()
    if len(vocab) != len(student_vocab):
        return f"{len(vocab)} tokens against {len(student_vocab)}"
    for token, index in student_vocab.items():
        if vocab.get(token) != index:
            return f"token {token!r} is id {vocab.get(token)} against {index}"
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(teacher, attr, None) != getattr(student, attr, None):
            return f"{attr} {getattr(teacher, attr, None)} against {getattr(student, attr, None)}"
    return None


class Teachers:
    """The run's TeacherPool and the engine actors behind it (restarted when one dies)."""

    def __init__(self, recipe: RecipeConfig, temperature: float, top_k: int, host: str = "127.0.0.1") -> None:
        self.recipe, self.temperature, self.top_k = recipe, temperature, top_k
        self.host = host  # where the teacher engines the run starts listen (cluster.engine_host)
        # A fresh key for the engines the run starts (as the policy's: no other local process or web page can drive
        # them); external teachers take $SLIME_DSA_API_KEY, as external rollout engines do.
        self.api_key = secrets.token_urlsafe(32)
        self.actors: dict[str, list[Any]] = {}  # teacher or "swap:<group>" -> its engine actors
        self.urls: dict[str, list[str]] = {}  # the same keys -> each actor's URL
        self._makers: dict[str, Callable[[], Any]] = {}  # the same keys -> a new (unstarted) actor of that kind
        self.pool: Any = None  # rollout.teachers.TeacherPool, once started

    async def start(self, probe_ids: list[int]) -> Any:
        """Start every teacher's engines, build the pool and have each teacher score `probe_ids` once (a teacher
        that cannot, e.g. one that ignores the rollout temperature, stops the run here with one line, and every
        teacher engine started so far is stopped)."""
        try:
            return await self._start(probe_ids)
        except BaseException:
            await self.close()
            raise

    async def _start(self, probe_ids: list[int]) -> Any:
        from rollout.client import EngineError  # noqa: PLC0415
        from rollout.teachers import DirectScorer, SwapEngine, TeacherPool  # noqa: PLC0415

        scorers, engines = [], []
        options = {"temperature": self.temperature, "top_k": self.top_k,
                   "timeout_s": self.recipe.rollout.request_timeout_s}
        groups: dict[str, list[TeacherConfig]] = {}
        for t in self.recipe.teachers:
            if t.serving == "swap":
                groups.setdefault(t.swap_group, []).append(t)
            elif t.serving != "external":
                self._makers[t.name] = self._factory(t.serving, t.path)
        for group, members in groups.items():
            self._makers[f"swap:{group}"] = self._factory("embedded", members[0].path, [t.path for t in members])
        count = {t.name: t.num_engines for t in self.recipe.teachers}
        await asyncio.gather(*(asyncio.to_thread(self._launch, key, count.get(key, 1)) for key in self._makers))
        for t in self.recipe.teachers:
            if t.serving != "swap":
                external = t.serving == "external"
                urls = list(t.urls) if external else self.urls[t.name]
                recover = None if external else self._recoverer(t.name)
                api_key = (os.environ.get(API_KEY_ENV) or None) if external else self.api_key
                scorers.append(DirectScorer(t.name, urls, recover=recover, api_key=api_key, **options))
        for group, members in groups.items():
            key = f"swap:{group}"
            engine = SwapEngine(group, self.urls[key][0], recover=self._recoverer(key), api_key=self.api_key,
                                **options)
            scorers += [engine.add(t.name, t.path) for t in members]
            engines.append(engine)
        self.pool = TeacherPool(scorers, {t.name: list(t.domains) for t in self.recipe.teachers}, engines)
        probes = await asyncio.gather(*(s.score([probe_ids], [1]) for s in scorers), return_exceptions=True)
        for scorer, result in zip(scorers, probes):
            if isinstance(result, (EngineError, RuntimeError)):
                raise UserError(f"teacher '{scorer.name}' cannot score: {result}")
            if isinstance(result, BaseException):
                raise result
        self.pool.reset_metrics()
        logger.info("%d teacher(s) ready: %s", len(scorers), ", ".join(self.pool.scorers))
        return self.pool

    def _launch(self, key: str, count: int) -> None:
        self.actors[key] = [self._makers[key]() for _ in range(count)]
        self.urls[key] = _start(self.actors[key])

    def _factory(self, kind: str, path: str, preload: list[str] | None = None) -> Callable[[], Any]:
        """A function that creates one (unstarted) engine actor serving `path` (and holding `preload` in host
        memory)."""
        from rollout.actors import create_engine_actors  # noqa: PLC0415
        from slime_dsa.orchestrator.setup import sglang_config  # noqa: PLC0415

        recipe, cl = self.recipe, self.recipe.cluster
        common = {"kind": kind, "num_gpus_per_engine": cl.num_gpus_per_engine,
                  "num_cpus_per_engine": cl.num_cpus_per_actor, "host": self.host}
        if kind == "sglang":
            config = sglang_config(recipe, path, api_key=self.api_key)
            return lambda: create_engine_actors(1, sglang_config=config, **common)[0]
        dtype = None if recipe.model.dtype == "auto" else recipe.model.dtype
        engine_kwargs = {"dtype": dtype, "max_cache_tokens": SCORING_CACHE_TOKENS,
                         "ops_backend": recipe.model.ops_backend, "preload_weights": list(preload or [])}
        # The engine's /update_weights_from_disk loads only from these (the swap group's members)
        server_kwargs = {"weight_dirs": list(preload or []), "api_key": self.api_key}
        return lambda: create_engine_actors(1, model_dir=str(path), engine_kwargs=engine_kwargs,
                                            server_kwargs=server_kwargs, **common)[0]

    def _recoverer(self, key: str) -> Callable[[list[str]], Any]:
        """The recover callback of teacher (or swap group) `key`: replace its actors at the dead URLs."""
        async def recover(dead: list[str]) -> list[str]:
            return await asyncio.to_thread(self._restart, key, dead)
        return recover

    def _restart(self, key: str, dead: list[str]) -> list[str]:
        """Kill the actors of `key` behind the dead URLs, start replacements; their URLs, in the order of `dead`."""
        import ray  # noqa: PLC0415

        from rollout.client import normalize_url  # noqa: PLC0415

        known = [normalize_url(u) for u in self.urls[key]]
        fresh = []
        for url in dead:
            i = known.index(normalize_url(url))
            ray.kill(self.actors[key][i], no_restart=True)
            self.actors[key][i] = self._makers[key]()
            (new,) = _start([self.actors[key][i]])
            self.urls[key][i], known[i] = new, normalize_url(new)
            fresh.append(new)
        logger.warning("%s: engine(s) %s restarted at %s", key, dead, fresh)
        return fresh

    async def close(self) -> None:
        """Close the pool's connections, stop and kill every teacher engine."""
        if self.pool is not None:
            await self.pool.close()
        await asyncio.to_thread(self._stop_actors)

    def _stop_actors(self) -> None:
        import ray  # noqa: PLC0415

        for actors in self.actors.values():
            for actor in actors:
                try:
                    ray.get(actor.stop.remote(), timeout=30)
                except Exception:  # noqa: BLE001 (shutting down: a dead engine has nothing to stop)
                    logger.debug("teacher engine stop failed", exc_info=True)
                ray.kill(actor)


def _start(actors: list[Any]) -> list[str]:
    from rollout.actors import start_engine_actors  # noqa: PLC0415

    return start_engine_actors(actors, timeout_s=600)

