"""The `teachers` list of a recipe: expert models that score the student's samples, one per domain (a task of
data.tasks), for algorithms whose advantages come from a teacher (opd). `check_teachers` holds the checks that
read other sections too; RecipeConfig calls it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from slime_dsa.algorithms.specs import ALGORITHMS, algorithm_class
from slime_dsa.config.section import Section
from slime_dsa.config.errors import RecipeValueError

Serving = Literal["embedded", "sglang", "external", "swap"]


class TeacherConfig(Section):
    """One teacher: its checkpoint, the domains it scores and how it is served."""

    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]+$", description="Name of the teacher in logs and metrics (teacher/<name>/...), "
                                                      "unique: letters, digits, '_', '.', '-' (a '/' would split its "
                                                      "metrics' W&B section).")
    path: str = Field(
        ..., min_length=1, description="Hugging Face directory of the expert checkpoint (config.json, safetensors, "
                                       "tokenizer). Its tokenizer must equal the student's: a run refuses to start "
                                       "otherwise.")
    domains: list[str] = Field(
        ..., min_length=1, description="Names of the data.tasks whose samples this teacher scores. A task has at "
                                       "most one teacher; a task without one is a reward domain, trained with GRPO's "
                                       "group advantages in the same batch.")
    serving: Serving = Field(
        "embedded", description="How the teacher is served. embedded: num_engines embedded engines of its own (Ray "
                                "actors, cluster.num_gpus_per_engine GPUs each); sglang: num_engines SGLang servers "
                                "launched for it (rollout.sglang settings; GPUs); external: running SGLang-compatible "
                                "servers at urls; swap: its weights wait in pinned CPU memory and are copied into an "
                                "embedded engine shared by its swap_group when its samples are scored (more teachers "
                                "than devices). Every mode scores by prefill only: /generate with max_new_tokens 0, "
                                "return_logprob and logprob_start_len over the sample's token ids.")
    num_engines: int = Field(1, ge=1, description="serving embedded or sglang: engines started for this teacher.")
    urls: list[str] = Field(
        default_factory=list, description="serving external: base URLs of the teacher's running servers (or of an "
                                          "SGLang router in front of them).")
    swap_group: str = Field(
        "shared", min_length=1, description="serving swap: teachers with the same swap_group share one engine, which "
                                            "holds one of them at a time.")

    @model_validator(mode="after")
    def _check(self) -> TeacherConfig:
        if self.serving == "external" and not self.urls:
            raise RecipeValueError("serving 'external' needs urls, the teacher's running servers", "urls", "serving")
        if self.serving != "external" and self.urls:
            raise RecipeValueError(f"urls are read by serving 'external', but serving is '{self.serving}'", "urls",
                                   "serving")
        if self.serving not in ("embedded", "sglang") and self.num_engines != 1:
            raise RecipeValueError(
                f"num_engines ({self.num_engines}) is read by serving 'embedded' and 'sglang', but serving is "
                f"'{self.serving}'", "num_engines", "serving")
        if self.serving != "swap" and self.swap_group != "shared":
            raise RecipeValueError(f"swap_group is read by serving 'swap', but serving is '{self.serving}'",
                                   "swap_group", "serving")
        if len(set(self.domains)) != len(self.domains):
            raise RecipeValueError(f"domains list a task twice: {self.domains}", "domains")
        return self


def check_teachers(recipe: Any) -> None:
    """The checks of the teachers list that read other sections (recipe: the RecipeConfig being validated);
    RecipeValueError names the keys."""
    alg, ro, teachers = recipe.algorithm, recipe.rollout, recipe.teachers
    spec = algorithm_class(alg.name)
    if spec.advantage_source != "teacher":
        if teachers:
            readers = [name for name, other in ALGORITHMS.items() if other.advantage_source == "teacher"]
            raise RecipeValueError(f"teachers are read only by algorithms with a teacher ({', '.join(readers)}), but "
                                   f"algorithm.name is '{alg.name}'", "teachers", "algorithm.name")
        return
    if not teachers:
        raise RecipeValueError(f"algorithm '{alg.name}' needs at least one entry in teachers", "teachers",
                               "algorithm.name")
    names = [t.name for t in teachers]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise RecipeValueError(f"teacher names must be unique, but '{twice}' appears {names.count(twice)} times",
                               "teachers")
    tasks = [t.name for t in recipe.data.tasks]
    owner: dict[str, str] = {}
    for i, teacher in enumerate(teachers):
        for domain in teacher.domains:
            if domain not in tasks:
                raise RecipeValueError(f"teacher '{teacher.name}' owns domain '{domain}', which is not a task of "
                                       f"data.tasks ({', '.join(tasks)})", f"teachers.{i}.domains", "data.tasks")
            if domain in owner:
                raise RecipeValueError(f"domain '{domain}' has two teachers, '{owner[domain]}' and '{teacher.name}'",
                                       f"teachers.{i}.domains")
            owner[domain] = teacher.name
        if teacher.serving == "sglang" and recipe.cluster.num_gpus_per_engine == 0:
            raise RecipeValueError(f"teacher '{teacher.name}' is served by 'sglang', which needs GPUs: set "
                                   "cluster.num_gpus_per_engine", f"teachers.{i}.serving", "cluster.num_gpus_per_engine")
    reward_domains = [t for t in tasks if t not in owner]
    if (reward_domains or alg.opd_task_advantage) and ro.n_samples_per_prompt < 2:
        why = (f"the reward domain '{reward_domains[0]}' has group advantages" if reward_domains
               else "algorithm.opd_task_advantage adds group advantages")
        raise RecipeValueError(f"rollout.n_samples_per_prompt ({ro.n_samples_per_prompt}) must be at least 2: {why}, "
                               "zero for a group of one", "rollout.n_samples_per_prompt")
    if ro.top_p < 1 or ro.top_k != -1:
        raise RecipeValueError(
            f"rollout.top_p ({ro.top_p}) and rollout.top_k ({ro.top_k}) must be off (1.0, -1) with algorithm "
            f"'{alg.name}': the student's log-probs would be of the truncated distribution, the teacher's of the whole "
            "one", "rollout.top_p", "rollout.top_k")
    if ro.dynamic_sampling:
        raise RecipeValueError(
            f"rollout.dynamic_sampling drops groups whose rewards agree; with algorithm '{alg.name}' a taught group "
            "learns from its teacher whatever its rewards", "rollout.dynamic_sampling", "algorithm.name")
