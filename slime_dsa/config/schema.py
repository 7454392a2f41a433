"""The recipe schema: one pydantic model per section. Every key is optional; the defaults train a tiny
model on a laptop CPU. Section validators check one section; `RecipeConfig` checks keys across sections.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from slime_dsa.algorithms.specs import ALGORITHMS, algorithm_class
from slime_dsa.config.errors import RecipeValueError
from slime_dsa.config.section import Section
from slime_dsa.config.teachers import TeacherConfig, check_teachers
from slime_dsa.data.task_params import task_params

# trainer.backend -> its trainer group class, by import path (trainers.build_trainer_group loads it). Adding a
# backend is its folder under trainers/ and one line here.
TRAINER_BACKENDS: dict[str, str] = {"fsdp": "trainers.fsdp.group:FSDPTrainerGroup",
                                    "megatron": "trainers.megatron.group:MegatronTrainerGroup",
                                    "deepspeed": "trainers.deepspeed.group:DeepSpeedTrainerGroup"}
PLANNED_TRAINER_BACKENDS: dict[str, str] = {}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def changed_keys(section: BaseModel, *names: str) -> list[str]:
    """Those of `names` whose value in `section` is not the field's default."""
    fields = type(section).model_fields
    return [name for name in names if getattr(section, name) != fields[name].get_default(call_default_factory=True)]
_REWARD_NAME = re.compile(r"^[A-Za-z_]\w*$")


# Requests an embedded engine runs at once by default (rollout.engine.defaults.DEFAULT_MAX_RUNNING_REQUESTS; a test
# keeps the two equal): the least a null rollout.max_concurrency resolves to per engine, so evaluation fills them.
ENGINE_RUNNING_REQUESTS = 256


class ModelSection(Section):
    """The policy model: where its weights and tokenizer come from and how it computes."""

    path: str | None = Field(
        None, description="Local Hugging Face model directory (with config.json, which must name eos_token_id) to "
                          "start from; a hub model is downloaded first (huggingface-cli download ORG/NAME "
                          "--local-dir DIR); null builds a tiny randomly initialised GLM-MoE-DSA model (CPU "
                          "quickstart).")
    preset: Literal["tiny", "quickstart", "small"] | None = Field(
        None, description="Size of the model built from scratch when path is null: tiny (~0.1M parameters, "
                          "tests), quickstart (~1.4M, the CPU quickstart) or small (~160M, one GPU); null = tiny. "
                          "Refused together with path (which loads its model): a recipe that inherits a preset "
                          "sets preset: null beside its path.")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "auto", description="Parameter dtype; auto = bfloat16 on GPU, float32 on CPU.")
    tokenizer_path: str | None = Field(
        None, description="Tokenizer directory or hub id; null = model.path (the built-in toy tokenizer when "
                          "model.path is null too). The driver, the trainers and the engines (SGLang's "
                          "--tokenizer-path) all use it. With path set it may hold no more token ids than that model's "
                          "embedding rows (config.json vocab_size), and its eos_token must be one of that "
                          "model's eos_token_id (config.json's or generation_config.json's; sft ends responses with "
                          "this; the engines stop on all of those and on this eos_token, as SGLang does). "
                          "With path null the preset's vocabulary and EOS are this tokenizer's (its highest token "
                          "id + 1, its eos_token, which it must have), and it is saved with the model built.")
    ops_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="Attention and indexer kernels: torch (reference, any device), triton (GPU), "
                            "auto = triton on GPU, torch on CPU.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations during the backward pass to save trainer memory.")
    index_topk: int | None = Field(
        None, ge=1, description="DSA keys each query attends to; null = the preset's (model built from scratch) or "
                                "model.path's config.json. At or above the sequence length attention is dense: DSA's "
                                "dense stage (train, then `slime-dsa indexer-warmup` to a sparse budget), which a "
                                "randomly initialised indexer needs, as it cannot learn which keys to select. With "
                                "model.path the model is copied into the run directory (initial_model) with this "
                                "budget in its config.json; the weights are the same.")
    true_on_policy: bool = Field(
        False, description="Batch-invariant kernels in the engine and the trainer (slime_dsa/ops/invariant.py): "
                           "every rollout log-prob equals the trainer's for the same token and weights bit for bit "
                           "(train/train_rollout_logprob_exact_frac 1), whatever the batches, so π_roll = π_old "
                           "and IcePop/TIS correct nothing. Slower steps. Built for embedded engines and the fsdp "
                           "trainer, on CPU and on CUDA (Triton kernels), engines and trainer in one dtype (float32, "
                           "or bfloat16 with trainer.mixed_precision); sampling unfiltered (rollout.top_p 1, top_k -1). "
                           "Not read by slime-dsa sft (refused set).")

    @property
    def scratch_preset(self) -> str:
        """The preset a model built from scratch (path null) has: preset, or tiny where it is null."""
        return self.preset or "tiny"

    @property
    def source(self) -> str:
        """What the run starts from, for one-line summaries: the path, or the preset built from scratch."""
        return self.path or f"a random {self.scratch_preset} model"

    @model_validator(mode="after")
    def _check(self) -> ModelSection:
        if self.path is not None and self.preset is not None:  # else path won and the preset was ignored, unsaid
            raise RecipeValueError(
                f"preset ('{self.preset}') and path ('{self.path}') are both set: model.path loads that model and "
                "model.preset sizes one built from scratch; set model.preset null (or drop it) to load the path, "
                "or model.path null to build the preset", "preset", "path")
        return self


# Tools the reference solutions of each built-in agentic task call (slime_dsa.data.tasks.TASKS[kind].tools; a test
# keeps the two equal). Kept here so that `recipe check` answers without importing datasets.
AGENTIC_TASK_TOOLS: dict[str, tuple[str, ...]] = {"calc_chain": ("calculator",), "fact_lookup": ("search", "calculator")}
BUILTIN_TOOLS = ("calculator", "search", "python")


class AgentConfig(Section):
    """Multi-turn tool use on a task: the agent loop, the tools it may call, and the limits of one trajectory."""

    loop: str = Field(
        "glm", description="Agent loop: glm (the model calls tools in GLM-4.5's <tool_call> format; rollout/agents) "
                           "or 'package.module:attribute' (an AgentLoop, or a class or function that makes one).")
    tools: list[str] = Field(
        default_factory=list, description="Tools the agent may call: calculator, search (BM25 over the built-in "
                                          "fact corpus), python (a sandboxed subprocess) or 'package.module:attribute'"
                                          " (a tool, or a class or function that makes one).")
    max_turns: int = Field(
        8, ge=1, description="Most model turns per trajectory; a trajectory still calling a tool in its last turn "
                             "ends truncated (metadata truncated_by: turns).")
    max_turn_tokens: int | None = Field(
        None, ge=1, description="Most tokens the model writes in one turn; null = rollout.max_response_length. The "
                                "whole trajectory, model and tool tokens, is capped by rollout.max_response_length; "
                                "either cut ends it truncated (truncated_by: tokens).")
    max_wall_time_s: float = Field(
        300.0, gt=0, description="Seconds one trajectory may take, generation and tools together; past it the "
                                 "trajectory ends truncated at its last finished turn (truncated_by: wall_time).")
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Seconds one tool call may run, waiting for a tool worker included; past it the "
                                "call's output says it timed out (the python tool's sandbox, or the worker running a "
                                "tool by import path, is killed then).")
    tool_isolation: Literal["process", "inline"] = Field(
        "process", description="Where the calls of tools given by import path run: process = in worker processes "
                               "(tool_workers per tool) under tool_timeout_s, tool_cpu_s and tool_memory_mb, where "
                               "a crash, a hang, a memory blow-up or megabytes of printing cost that call and the "
                               "worker is replaced; the tool is made once per worker by its import path, so its "
                               "state lives per worker; a sync call runs there too. inline = in the driver, on the "
                               "plugin loop (faster; for light async tools that serve many calls at once or keep "
                               "one state for the run; a sync call blocks that loop while it runs, and a crash or a "
                               "memory blow-up takes the run with it). "
                               "The built-in tools ignore it (python always runs sandboxed).")
    tool_workers: int | None = Field(
        None, ge=1, description="tool_isolation process: worker processes per tool by import path, each running one "
                                "call at a time (the others wait, within their tool_timeout_s); null = the machine's "
                                "cores, at most 4.")
    tool_cpu_s: int = Field(
        5, ge=1, description="CPU seconds one call of the python tool's sandboxed process (RLIMIT_CPU), or of a tool "
                             "by import path in its worker (tool_isolation process), may use; past it the process is "
                             "killed and the call's output says so.")
    tool_memory_mb: int = Field(
        512, ge=64, description="python tool: MiB of address space one call's sandboxed process may map "
                                "(RLIMIT_AS); an allocation past it raises MemoryError in the script. A tool by import "
                                "path (tool_isolation process): MiB its worker may map beyond what making the tool "
                                "took; a MemoryError past it costs the call and the worker.")
    tool_max_processes: int = Field(
        8, ge=1, description="python tool: processes one call's sandbox may run at once (RLIMIT_NPROC); a fork "
                             "past it fails in the script. Not applied to tools by import path (RLIMIT_NPROC counts "
                             "every process of the user, and their workers run as the driver's user).")
    max_tool_calls_per_turn: int = Field(
        4, ge=1, description="Tool calls run per turn; further calls in the same turn get an error as output.")
    max_tool_output_chars: int = Field(
        1000, ge=32, description="Characters of one tool output the model sees; the rest is cut, with a note (a "
                                 "python tool script that prints more than max(8192, 4 × this) bytes is killed).")

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        if self.loop != "glm" and not _IMPORT_PATH.match(self.loop):
            raise RecipeValueError(f"loop ('{self.loop}') must be glm or look like 'package.module:attribute'", "loop")
        for tool in self.tools:
            if tool not in BUILTIN_TOOLS and not _IMPORT_PATH.match(tool):
                raise RecipeValueError(f"tools: '{tool}' is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) or "
                                       "'package.module:attribute'", "tools")
        if len(set(self.tools)) != len(self.tools):
            raise RecipeValueError(f"tools lists a tool twice: {self.tools}", "tools")
        plugin_tools = [t for t in self.tools if _IMPORT_PATH.match(t)]
        if self.tool_workers is not None and (self.tool_isolation != "process" or not plugin_tools):
            why = (f"tool_isolation is '{self.tool_isolation}'" if plugin_tools else
                   "tools lists none (the built-in tools run no workers)")
            raise RecipeValueError(f"tool_workers ({self.tool_workers}) applies to tools by import path run with "
                                   f"tool_isolation 'process', but {why}", "tool_workers", "tool_isolation")
        if changed_keys(self, "tool_max_processes") and "python" not in self.tools:
            raise RecipeValueError(f"tool_max_processes ({self.tool_max_processes}) applies to the python tool's "
                                   "sandbox, which tools does not list", "tool_max_processes", "tools")
        if self.tool_timeout_s > self.max_wall_time_s:
            raise RecipeValueError(f"tool_timeout_s ({self.tool_timeout_s:g}) exceeds max_wall_time_s "
                                   f"({self.max_wall_time_s:g}), the whole trajectory's time", "tool_timeout_s",
                                   "max_wall_time_s")
        return self


class TaskConfig(Section):
    """One prompt source; `data.tasks` mixes several by weight."""

    name: str | None = Field(
        None, description="Name of the task in metrics and logs, unique within data.tasks; null = the kind.")
    kind: Literal["arithmetic", "countdown", "sort", "calc_chain", "fact_lookup", "dataset"] = Field(
        "arithmetic", description="Where prompts come from: a built-in generator (arithmetic, countdown, sort; the "
                                  "agentic calc_chain and fact_lookup, which need tools) or a dataset at `path`.")
    weight: float = Field(
        1.0, ge=0, description="Relative share of this task in each step's prompts (normalised over all tasks).")
    path: str | None = Field(
        None, description="Hugging Face dataset id or local jsonl/json/parquet file or directory; required "
                          "for kind dataset.")
    split: str = Field("train", description="Dataset split that training prompts are drawn from (kind dataset).")
    prompt_column: str = Field(
        "prompt", description="Column holding the prompt, a string or a list of chat messages (kind dataset).")
    answer_column: str = Field(
        "answer", description="Column holding the reference answer given to the reward function (kind dataset).")
    reward_fn: str | None = Field(
        None, description="Reward function: a registered name (arithmetic, countdown, sort, math_verify or its "
                          "alias math, tool_answer: the agentic tasks' answer check) or 'package.module:function'; "
                          "null = the task's built-in verifier.")
    system_prompt: str | None = Field(
        None, description="System message put before every prompt of this task; null = none.")
    train_size: int = Field(
        20000, ge=1, description="Prompts generated for a built-in task (every kind but dataset).")
    task_args: dict[str, int | float | bool | str] = Field(
        default_factory=dict, strict=False,
        description="Parameters of a built-in task generator (slime_dsa.data.task_params; a wrong name, type "
                    "or range is an error). arithmetic: min_digits, max_digits, num_operands, ops, allow_negative. "
                    "countdown: min_numbers, max_numbers, max_number, max_target, ops, use_all (each number "
                    "exactly once), worked_steps (the reference solution, which SFT learns, works the steps out "
                    "in <think> before <answer>: ~150 tokens at 3-4 numbers, ~260 at 5-6), worked_search (with "
                    "worked_steps: <think> first lists every pair combined by each op: ~280 tokens at 3 "
                    "numbers). sort: min_numbers, "
                    "max_numbers, max_number. calc_chain: start_digits, min_steps, max_steps, operand_digits, "
                    "ops. fact_lookup: questions. E.g. {max_digits: 2} for arithmetic.")
    eval_fraction: float = Field(
        0.0, ge=0, lt=1, description="Fraction of the task's prompts held out for evaluation; set at most one "
                                     "of eval_fraction and eval_size.")
    eval_size: int = Field(
        0, ge=0, description="Number of the task's prompts held out for evaluation; set at most one of "
                             "eval_fraction and eval_size.")
    agent: AgentConfig | None = Field(
        None, description="Multi-turn tool use: each rollout of this task is a trajectory of model turns and tool "
                          "results; null = one response per rollout (the agentic kinds calc_chain and fact_lookup "
                          "then get the glm loop with the tools they need).")

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.name is None:
            self.name = self.kind
        needed = AGENTIC_TASK_TOOLS.get(self.kind, ())
        if needed and self.agent is None:
            self.agent = AgentConfig(tools=list(needed))
        missing = [t for t in needed if self.agent is not None and t not in self.agent.tools]
        if missing:
            raise RecipeValueError(f"kind '{self.kind}' needs the tool '{missing[0]}' in agent.tools", "agent.tools",
                                   "kind")
        if self.kind == "dataset" and not self.path:
            raise RecipeValueError("kind 'dataset' needs a path (a dataset id, file or directory)", "path", "kind")
        if self.kind != "dataset" and self.path is not None:
            raise RecipeValueError(
                f"path ('{self.path}') is only read by kind 'dataset', but kind is '{self.kind}'", "path", "kind")
        dataset_keys = changed_keys(self, "split", "prompt_column", "answer_column")
        if self.kind != "dataset" and dataset_keys:
            key = dataset_keys[0]
            raise RecipeValueError(
                f"{key} ('{getattr(self, key)}') is only read by kind 'dataset', but kind is '{self.kind}'", key, "kind")
        if self.reward_fn is not None and not (_IMPORT_PATH.match(self.reward_fn) or _REWARD_NAME.match(self.reward_fn)):
            raise RecipeValueError(
                f"reward_fn ('{self.reward_fn}') must be a registered name or look like 'package.module:function'",
                "reward_fn")
        if self.kind == "dataset" and changed_keys(self, "train_size"):
            raise RecipeValueError(
                f"train_size ({self.train_size}) is only read by built-in kinds, but kind is 'dataset' (its rows are "
                "the prompts)", "train_size", "kind")
        if self.task_args and self.kind == "dataset":
            raise RecipeValueError("task_args only apply to built-in tasks (arithmetic, countdown, sort, calc_chain, "
                                   "fact_lookup)", "task_args", "kind")
        if self.kind != "dataset":
            try:
                task_params(self.kind, **self.task_args)
            except ValueError as exc:
                raise RecipeValueError(str(exc), *(f"task_args.{k}" for k in self.task_args)) from None
        if self.eval_fraction > 0 and self.eval_size > 0:
            raise RecipeValueError(
                f"set at most one of eval_fraction ({self.eval_fraction}) and eval_size ({self.eval_size})",
                "eval_fraction", "eval_size")
        return self

    @property
    def has_eval_split(self) -> bool:
        """Whether this task holds prompts out for evaluation."""
        return self.eval_fraction > 0 or self.eval_size > 0


def _default_tasks() -> list[TaskConfig]:
    return [TaskConfig(name="arithmetic", kind="arithmetic")]


class DataSection(Section):
    """Prompts: the tasks to train on, mixed by weight, and how prompts are formatted."""

    tasks: list[TaskConfig] = Field(
        default_factory=_default_tasks, min_length=1,
        description="Prompt sources; each step draws prompts from every task in proportion to its weight.")
    apply_chat_template: bool = Field(
        False, description="Wrap each prompt in the tokenizer's chat template (as a user turn) before tokenising.")
    max_prompt_length: int = Field(
        512, ge=1, description="Prompts longer than this many tokens are dropped (and counted in the logs).")
    seed: int = Field(42, description="Seed for prompt shuffling, task mixing and the built-in generators.")

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        names = [t.name for t in self.tasks]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RecipeValueError(
                f"task names must be unique, but {duplicates[0]!r} appears {names.count(duplicates[0])} times; "
                "give each task a name", "tasks")
        if sum(t.weight for t in self.tasks) <= 0:
            raise RecipeValueError("the weights of data.tasks sum to 0; at least one task needs weight > 0", "tasks")
        return self


class SGLangSection(Section):
    """SGLang server settings, used when `rollout.engine` is sglang."""

    tp: int = Field(1, ge=1, description="Tensor-parallel size of each SGLang server (--tp-size).")
    mem_fraction_static: float = Field(
        0.8, gt=0, lt=1, description="Fraction of GPU memory SGLang takes for weights and KV cache "
                                     "(--mem-fraction-static).")
    kv_cache_dtype: Literal["auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = Field(  # rollout/sglang/config.py's
        "auto", description="KV cache dtype of the SGLang servers (--kv-cache-dtype); auto = the model's dtype.")
    attention_backend: str = Field(
        "nsa", description="SGLang attention backend (--attention-backend); nsa is its DeepSeek-Sparse-Attention "
                           "backend.")
    extra_args: list[str] = Field(
        default_factory=list, description="Extra arguments passed verbatim to sglang.launch_server, e.g. "
                                          "['--enable-dp-attention'].")
    weight_sync: Literal["auto", "distributed", "tensor", "disk"] = Field(
        "auto", description="How new weights reach the SGLang servers after each step: distributed (trainer rank 0 "
                            "and every server rank form an NCCL group; rank 0 broadcasts while the servers receive "
                            "through /update_weights_from_distributed), disk (trainer rank 0 writes the weights as "
                            "safetensors into <run directory>/engine_weights and every server loads them through "
                            "/update_weights_from_disk: with several nodes, put logging.run_dir on a filesystem "
                            "every node sees at the same path); auto = distributed when cluster.placement is "
                            "disaggregated, disk when colocated (NCCL cannot put two ranks on one GPU). tensor "
                            "(SGLang's in-memory CUDA-IPC format) is not available yet.")


def _url_problem(url: str) -> str | None:
    """Why `url` is not a server's base URL as rollout.client takes it ('host:port' or http(s)://host[:port]), or
    None."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    url = url.strip()
    if "://" in url and not url.startswith(("http://", "https://")):
        return "is not an http:// or https:// URL"
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        parts.port
    except ValueError:
        return "has no valid port"
    return None if parts.hostname else "names no host"


class RolloutSection(Section):
    """Generation: engines, sampling parameters, group size and concurrency."""

    engine: Literal["embedded", "sglang", "external"] = Field(
        "embedded", description="Generation engine: embedded (ours, in Ray actors, CPU or GPU), sglang (SGLang "
                                "servers launched for the run), external (servers already running at engine_urls).")
    num_engines: int = Field(
        1, ge=1, description="Engines to start (embedded, sglang); engine external uses one per URL instead.")
    engine_urls: list[str] = Field(
        default_factory=list, description="Base URLs of running SGLang-compatible servers or of an SGLang router "
                                          "(engine external only).")
    n_samples_per_prompt: int = Field(
        8, ge=1, description="Responses sampled per prompt: the group of group-normalised advantages.")
    prompts_per_step: int = Field(
        4, ge=1, description="Prompts per RL step; a step trains on prompts_per_step × n_samples_per_prompt "
                             "samples.")
    max_concurrency: int | None = Field(
        None, ge=1, description="Most rollouts in flight at once, over all engines; null = every rollout the loop "
                                "can start at once: one step's samples, prompts_per_step × n_samples_per_prompt "
                                "(x max_oversample_factor with dynamic_sampling), in the synchronous loop; "
                                "max_staleness + 1 steps' samples in the asynchronous one; at least 256 per "
                                "engine, what an embedded engine runs at once (`recipe check` shows the value). A value below one step's samples leaves the rest waiting for a free "
                                "place, and the step waits on their tail (`recipe check` says so).")
    max_cache_tokens: int | None = Field(
        None, ge=16, description="KV cache of each embedded engine, in tokens; null = room for every rollout that "
                                 "can be in flight at once, so none waits in the engine's queue: one step's groups "
                                 "(x max_oversample_factor with dynamic_sampling) in the synchronous loop, "
                                 "max_staleness + 1 steps' groups in the asynchronous one, at most max_concurrency "
                                 "requests, split over num_engines, each reserving max_prompt_length + "
                                 "max_response_length tokens.")
    overlap_schedule: bool | None = Field(
        None, description="Embedded engines launch each decode step before they read the previous step's tokens, "
                          "so the host's bookkeeping runs while the GPU computes (SGLang's overlap scheduler); the "
                          "outputs are the same. null: on for embedded engines (the 16 x 16 RL step on an H200 "
                          "took 0.36 s with it, 0.43 s without: benchmarks/RESULTS.md); false turns it off. SGLang and "
                          "external servers set their own (leave it null for them).")
    num_continuous_decode_steps: int | None = Field(
        None, ge=1, le=64,
        description="Embedded engines decode this many steps a launch while every running request decodes (none "
                    "waiting, none streaming, none within that many tokens of its limit): each step takes the last "
                    "one's tokens on the GPU and the host schedules and books once for them (SGLang's "
                    "--num-continuous-decode-steps); the same tokens (log-probs within 1e-5). null: 4 for embedded engines (at 64 x "
                    "16 on an H100 the decode steps' host gap fell from ~37% to ~10%: benchmarks/RESULTS.md); 1 "
                    "launches every step alone. SGLang and external servers set their own (leave it null for them).")
    enable_torch_compile: bool = Field(
        False, description="Embedded engines' decode steps run the model's small pointwise chains (norms, rotations, "
                           "routing, activations) through torch.compile, fused into a few kernels each, so a decode "
                           "graph holds fewer kernels (SGLang's --enable-torch-compile); prefill steps stay eager. "
                           "They compile when first met, in the engines' warm-up on a GPU. Off by default: at 64 x 16 "
                           "on an H100 (a first build that fused prefill steps too) the decode step was ~7% faster "
                           "and the RL step not measurably (benchmarks/RESULTS.md). Not with model.true_on_policy, whose batch-invariant ops replace "
                           "them; SGLang and external servers set their own.")
    index_key_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="How embedded engines cache the DSA indexer's keys: auto (the model's dtype) or fp8_e4m3 "
                            "(one float32 scale a key row, as DeepSeek's and SGLang's DSA caches hold them: half the "
                            "bytes the decode indexer reads, the part of a long-context decode step bound by them). "
                            "The engines' top-k selections may then differ from the trainer's, which scores the "
                            "model-dtype keys: rollout.return_indexer_topk with algorithm.index_replay trains on "
                            "the engines' selections. Not with model.true_on_policy; SGLang servers set their own "
                            "(--kv-cache-dtype).")
    coalesce_calls: bool = Field(
        False, description="Send the group calls that the driver makes at once (before its event loop next waits) "
                          "to one embedded engine in batch /generate bodies of up to coalesce_max_samples samples, "
                          "each prompt with its own seeds and request ids, so the engine gets a step in a few "
                          "requests instead of a burst of calls it waits for; the samples are the same, a merged "
                          "body that fails sends its calls again alone, and a merged call answers with its slowest "
                          "member (rollout/coalesce.py). "
                          "Off by default: on CPU it cut the 64 x 16 burst's wait before the engine's first step but "
                          "not the rollout's wall time, and on one H200 the rollout took longer with it (450 against "
                          "354 ms for 1,024 samples; benchmarks/RESULTS.md). "
                          "Embedded engines only; SGLang and external engines get one call per group.")
    prefetch_next_step: bool = Field(
        False, description="Synchronous loop, embedded engines: send the next step's first sampling round to the "
                           "engines while the trainer steps (the engines paused: they hold the calls and generate "
                           "them under the new weights once the push continues them), so that rollout starts "
                           "without the calls' transfer and admission. Same prompts, seeds and weights as without "
                           "it; steps that evaluate or save a checkpoint, and the last, do not prefetch "
                           "(perf/rollout_prefetched says which did). The calls wait through the train call and the "
                           "push: a step whose last train call and push took over half of rollout.request_timeout_s "
                           "does not prefetch (a warning says so once). Off by default (on two CPU cores it "
                           "gained nothing); recipes/gpu_single.yaml turns it on: on one H200 at 64 x 16 it took "
                           "the colocated step from 0.55 to 0.47 s.")
    coalesce_max_samples: int = Field(
        64, ge=1, le=4096, description="With coalesce_calls: most samples in one merged body (a group is never "
                                        "split). A body answers when its slowest sample ends, and its answers are "
                                        "built and read in one piece after that: smaller bodies let the early ones' "
                                        "answers overlap the later ones' decoding.")
    max_response_length: int = Field(
        512, ge=1, description="Most tokens generated per response (max_new_tokens); longer responses are cut "
                               "and marked truncated.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: sample from the smallest set of tokens holding this much "
                                     "probability; 1 = off.")
    top_k: int = Field(-1, ge=-1, description="Sample from the k most likely tokens only; -1 = the whole vocabulary.")
    stop: list[str] = Field(
        default_factory=list, description="Strings that end a response when generated, besides the EOS token.")
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts "
                           "until the step is full.")
    oversample_factor: float = Field(
        1.0, ge=1, description="With dynamic_sampling, synchronous loop: draw this many times prompts_per_step "
                               "prompts per sampling round.")
    max_oversample_factor: float = Field(
        4.0, ge=1, description="With dynamic_sampling, synchronous loop: rounds grow as groups get dropped, to the "
                               "groups still needed x oversample_factor / the share of groups the last round kept, at "
                               "most this many times the groups still needed (so one round usually fills the step); "
                               "equal to oversample_factor = fixed rounds.")
    max_sampling_tries: int = Field(
        4, ge=1, description="With dynamic_sampling, synchronous loop: most sampling rounds per step before "
                             "training on the groups collected so far (the asynchronous loop replaces each dropped "
                             "group as it goes, and stops the run when one step drops 16 steps' groups beyond those "
                             "in flight).")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Seconds to wait for one generation request before giving up on it.")
    reward_timeout_s: float = Field(
        30.0, gt=0, description="Seconds one reward call may run; a call past it scores 0 and counts in "
                                "rollout/reward_timeouts (a function given as 'package.module:function' has its "
                                "worker process killed and replaced).")
    reward_timeout_warn_share: float = Field(
        0.01, ge=0, le=1, description="Log a WARNING when more than this share of a step's reward calls time out.")
    return_indexer_topk: bool = Field(
        False, description="Ask engines for the DSA indexer's top-k key indices of every row of prompt and "
                           "response (for algorithm.index_replay; without it, train/index_topk_mismatch logs the "
                           "share of the trainer's selection that differs from the engines'; embedded engines then "
                           "keep each cached row's top-k with the KV cache).")
    weight_sync: Literal["auto", "http", "shm", "cuda_ipc"] = Field(
        "auto", description="How embedded or external engines get new weights after each step (SGLang servers "
                            "launched for the run: rollout.sglang.weight_sync): http (the "
                            "state dict in /update_weights_from_tensor requests; engines anywhere), shm (trainer "
                            "rank 0 writes a safetensors file under /dev/shm that each engine loads through "
                            "/update_weights_from_disk; engines on rank 0's host only), cuda_ipc (rank 0 keeps "
                            "the weights in one buffer on its GPU and each engine copies them device to device "
                            "through a CUDA IPC handle; embedded engines on rank 0's GPU only); auto = cuda_ipc "
                            "when every engine is an embedded engine on rank 0's GPU, else shm when they are on "
                            "rank 0's node and /dev/shm has room, else http.")
    restart_dead_engines: bool = Field(
        True, description="Replace an engine the run started (embedded, sglang) whose process died: the run goes on "
                          "with the others meanwhile, and the new engine joins at the next weight update (not with "
                          "rollout.sglang.weight_sync distributed, auto's choice when disaggregated: its NCCL group "
                          "cannot take a new member). An external server (engine external) that is lost is probed "
                          "on /health instead and rejoins at the next weight update once it answers. Off, the run goes "
                          "on with fewer engines. Either way, when none is left (and none comes back within 10 "
                          "minutes) the run writes an emergency checkpoint and stops.")
    sglang: SGLangSection = Field(
        default_factory=SGLangSection, description="SGLang server settings (engine sglang).")

    @model_validator(mode="after")
    def _check(self) -> RolloutSection:
        if self.top_k == 0:
            raise RecipeValueError("top_k (0) must be -1 (off) or at least 1", "top_k")
        if self.engine == "external" and not self.engine_urls:
            raise RecipeValueError("engine 'external' needs engine_urls, the URLs of the running servers",
                                   "engine", "engine_urls")
        if self.engine != "external" and self.engine_urls:
            raise RecipeValueError(
                f"engine_urls ({len(self.engine_urls)} given) are only used by engine 'external', but engine is "
                f"'{self.engine}'", "engine_urls", "engine")
        for i, url in enumerate(self.engine_urls):
            if problem := _url_problem(url):
                raise RecipeValueError(f"engine_urls[{i}] {url!r} {problem} (give http://HOST:PORT or HOST:PORT)",
                                       "engine_urls")
        if self.engine == "external" and self.num_engines != 1:
            raise RecipeValueError(
                f"num_engines ({self.num_engines}) counts the engines the run starts (embedded, sglang); engine "
                f"'external' uses one per URL of engine_urls ({len(self.engine_urls)} given)", "num_engines", "engine")
        if self.max_cache_tokens is not None and self.engine != "embedded":
            raise RecipeValueError(
                f"max_cache_tokens ({self.max_cache_tokens}) sizes the embedded engine's KV cache, but engine is "
                f"'{self.engine}'", "max_cache_tokens", "engine")
        rounds = changed_keys(self, "oversample_factor", "max_oversample_factor", "max_sampling_tries")
        if rounds and not self.dynamic_sampling:
            raise RecipeValueError(
                f"{rounds[0]} ({getattr(self, rounds[0])}) only applies with dynamic_sampling: true",
                rounds[0], "dynamic_sampling")
        if self.max_oversample_factor < self.oversample_factor:
            raise RecipeValueError(
                f"max_oversample_factor ({self.max_oversample_factor}) must be at least oversample_factor "
                f"({self.oversample_factor})", "max_oversample_factor", "oversample_factor")
        return self

    def coalesces_calls(self) -> bool:
        """Whether the driver's client merges each burst of group calls per engine (coalesce_calls, embedded engines)."""
        return self.engine == "embedded" and self.coalesce_calls

    def client_coalesce(self) -> bool | int:
        """EngineClient's `coalesce` for the driver: the most samples a merged body carries, False when off."""
        return self.coalesce_max_samples if self.coalesces_calls() else False

    def step_samples(self) -> int:
        """Samples of one synchronous step's largest sampling round: prompts_per_step × n_samples_per_prompt, the
        rounds of dynamic sampling up to max_oversample_factor times that."""
        groups = self.prompts_per_step
        if self.dynamic_sampling:
            groups = max(groups, round(groups * self.max_oversample_factor))
        return groups * self.n_samples_per_prompt


class AlgorithmSection(Section):
    """The RL objective: advantages, clipping, importance-sampling corrections, KL, indexer training."""

    name: str = Field(
        "grpo", description="Algorithm (slime_dsa/algorithms/specs): grpo (synchronous, clipped ratio against "
                            "π_old), async_reinforce (asynchronous REINFORCE with double-sided IS), sao (single-rollout "
                            "asynchronous optimisation: double-sided IS on per-token GAE from a value model, the "
                            "critic section), opd (on-policy distillation: GRPO's loss on per-token advantages from "
                            "each domain's teacher, the teachers list). Each algorithm reads the keys of this "
                            "section its description names; setting another away from its default is an error "
                            "(`slime-dsa recipe explain NAME` lists one algorithm's keys).")
    advantage_std_normalize: bool = Field(
        True, description="grpo, opd: divide group advantages by the group's reward std; false = Dr. GRPO.")
    eps_clip_low: float = Field(
        0.2, ge=0, lt=1, description="grpo, opd: the ratio π_θ/π_old is clipped below at 1 − eps_clip_low.")
    eps_clip_high: float = Field(
        0.28, ge=0, description="grpo, opd: Clip-Higher (DAPO), the ratio π_θ/π_old is clipped above at 1 + eps_clip_high.")
    dual_clip_c: float | None = Field(
        None, gt=1, description="grpo, opd: dual clip for negative advantages: the loss of a token is bounded by c·|A| "
                                "(typically 3.0); null = off.")
    is_correction: Literal["none", "icepop", "tis"] = Field(
        "none", description="grpo, opd: correction for the training–inference mismatch k = π_old/π_roll: icepop drops "
                            "tokens with k outside [icepop_alpha, icepop_beta], tis weights by min(k, tis_cap).")
    icepop_alpha: float = Field(
        0.5, ge=0, le=1, description="grpo, opd, IcePop: tokens with π_old/π_roll below this get no gradient.")
    icepop_beta: float = Field(
        2.0, ge=1, description="grpo, opd, IcePop: tokens with π_old/π_roll above this get no gradient.")
    tis_cap: float = Field(2.0, ge=1, description="grpo, opd, TIS: cap C of the importance weight min(π_old/π_roll, C).")
    loss_aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean", description="How token losses make the batch loss: token_mean (over all masked tokens of "
                                  "the batch, DAPO) or seq_mean (per response first, then over responses).")
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the KL penalty to the reference (initial) policy. Not available yet (no "
                               "reference model is kept): must be 0.")
    kl_estimator: Literal["k1", "k3", "low_var_kl"] = Field(
        "k3", description="Estimator of the KL penalty (with kl_coef > 0, not available yet): k1 (log ratio), k3 "
                          "(unbiased, non-negative), low_var_kl (k3 clamped to [-10, 10]).")
    use_rollout_logprobs: bool = Field(
        False, description="grpo, opd: bypass mode, use the engine's log-probs as π_old instead of recomputing them on the "
                           "trainer (saves a forward pass).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus; 0 = off.")
    dis_eps_low: float = Field(
        0.3, gt=0, le=1, description="async_reinforce, sao: double-sided IS; tokens with π_θ/π_roll at or below "
                                     "1 − dis_eps_low get no gradient. Default 0.3: the SAO paper's maths setting "
                                     "(its code setting: 0.8).")
    dis_eps_high: float = Field(
        5.0, gt=0, description="async_reinforce, sao: double-sided IS; tokens with π_θ/π_roll at or above "
                               "1 + dis_eps_high get no gradient. Default 5.0: the SAO paper's maths setting (its "
                               "code setting: 3.0).")
    max_staleness: int = Field(
        2, ge=0, description="async_reinforce, sao: drop samples whose oldest token's policy version lags the "
                             "trainer's by more than this many versions, and never let rollout run more than "
                             "this many steps ahead of training; 0 = on-policy only (the synchronous loop). "
                             "Default 2: ours (GLM-5 leaves it undisclosed).")
    gae_gamma: float = Field(
        1.0, ge=0, le=1, description="sao: discount γ of GAE over action tokens. Default 1 (no discount): the SAO "
                                     "paper.")
    gae_lambda_alpha: float = Field(
        1.5, gt=0, description="sao: α of the actor's length-adaptive λ = 1 − 1/(α·l), l the trajectory's action "
                               "tokens, clamped to [0, 1]. Default 1.5: the SAO paper, after VAPO.")
    critic_gae_lambda: float = Field(
        1.0, ge=0, le=1, description="sao: λ of the critic's value targets; 1 = Monte-Carlo returns. Default 1: the "
                                     "SAO paper.")
    critic_updates_per_step: int = Field(
        2, ge=1, description="sao: K, passes of critic updates over each step's trajectories for the actor's one "
                             "(each pass takes trainer.num_steps_per_rollout optimizer steps, as the actor does). "
                             "Default 2: the SAO paper.")
    critic_warmup_steps: int = Field(
        10, ge=0, description="sao: the first this many RL steps train only the critic (the policy's weights stay "
                              "as they are; rollout goes on with them). Equal to trainer.num_steps, the run is value "
                              "pre-training of a fixed policy (recipes/value_pretrain.yaml). Default 10: the SAO "
                              "paper's example (its exact value is undisclosed).")
    value_clip: float | None = Field(
        None, gt=0, description="sao: clip each value update to V_old ± value_clip in the value loss (PPO-style; "
                                "0.2–0.5 in PPO critics); null = plain masked MSE. Default null: implementers of "
                                "the SAO paper read it as unclipped, and sources disagree.")
    bootstrap_truncated: bool = Field(
        True, description="sao: a trajectory an agent loop cut at one of its limits (turns, tokens, wall time: status "
                          "truncated with metadata truncated_by) ends its GAE on γ·V(state after its last token) "
                          "instead of 0, its reward still on its last action token. A single response cut at "
                          "rollout.max_response_length ends its episode (its reward function scored it): never "
                          "bootstrapped. Default true: issue 15 (an agent's limit is not the end of the episode).")
    partial_rollout: Literal["retract", "in_place", "off"] = Field(
        "retract", description="async_reinforce, sao: responses in progress when new weights arrive are continued "
                               "under them (a partial rollout; each token keeps the version and log-prob it was sampled "
                               "with): retract recomputes their cache under the new weights, in_place keeps the "
                               "cache computed under the old ones; off aborts and regenerates them from scratch. "
                               "Default retract: ours (SGLang's retract pause mode).")
    opd_coef: float = Field(
        1.0, ge=0, description="opd: λ, the weight of the teacher's signal: a taught token's advantage is −opd_coef · "
                               "(log π_roll − log π_teacher), the sampled reverse KL (or, with opd_topk, the weight of "
                               "the top-k KL in the loss). Default 1: Thinking Machines' on-policy distillation.")
    opd_topk: int = Field(
        0, ge=0, le=1024, description="opd: 0 = the teacher scores the sampled tokens only (the sampled estimate "
                                      "above); k > 0 = each teacher returns its top-k log-probs per position "
                                      "(top_logprobs_num) and the loss adds opd_coef × a sparse KL(student ‖ teacher) "
                                      "over those k ids plus a tail bucket for the rest of the mass, instead of the "
                                      "advantage (e.g. 16). Default 0: ours (the sampled estimate is the published "
                                      "method).")
    opd_task_advantage: bool = Field(
        False, description="opd: add the group advantage of the task reward (as grpo computes it) to the advantages "
                           "of taught samples too; reward domains (tasks without a teacher) always get it. Default "
                           "false: pure distillation (docs/algorithms.md section 7).")
    indexer_loss_coef: float = Field(
        0.0, ge=0, description="Weight of the DSA indexer loss, KL(attention distribution ‖ indexer scores), "
                               "added to the RL loss; 0 = the indexer is not trained.")
    freeze_indexer: bool = Field(
        False, description="Keep the DSA indexers' parameters fixed. They are fixed already unless "
                           "indexer_loss_coef > 0, which contradicts it, so true is refused either way.")
    index_replay: bool = Field(
        False, description="Train with the top-k indices the engine used during rollout, so that training "
                           "attends to the same keys (needs rollout.return_indexer_topk).")
    indexer_learning_rate: float | None = Field(
        None, gt=0, description="Learning rate of the DSA indexers' own optimizer param group (with "
                                "indexer_loss_coef > 0); null = trainer.learning_rate.")
    indexer_loss_stage: Literal["sparse", "dense"] = Field(
        "sparse", description="Key set of the indexer loss (with indexer_loss_coef > 0): sparse = the selected top-k "
                              "(the RL-time stage), dense = every causal key (as in the warm-up).")
    indexer_loss_target: Literal["group", "own"] = Field(
        "group", description="Target of the indexer loss (with indexer_loss_coef > 0): group = mean attention of "
                             "every layer that reuses the indexer's top-k (IndexShare group), own = the indexer's own "
                             "layer only.")

    @field_validator("partial_rollout", mode="before")
    @classmethod
    def _off_is_a_word(cls, value: object) -> object:
        """YAML 1.1 reads a bare `off` as false: take it as the word."""
        return "off" if value is False else value

    @field_validator("name")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        try:
            algorithm_class(name)
        except ValueError as e:
            raise RecipeValueError(str(e)) from None
        return name

    @model_validator(mode="after")
    def _check(self) -> AlgorithmSection:
        spec = algorithm_class(self.name)
        for key, field in type(self).model_fields.items():
            if not spec.reads(key) and getattr(self, key) != field.default:
                readers = [name for name, other in ALGORITHMS.items() if other.reads(key)]
                raise RecipeValueError(
                    f"{key} is not read by algorithm '{self.name}' (it applies to {', '.join(readers) or 'none yet'}); "
                    "remove it or change name", key, "name")
        if self.kl_coef > 0:
            raise RecipeValueError(
                f"kl_coef ({self.kl_coef}) is not available yet: no reference model is kept; set it to 0", "kl_coef")
        if changed_keys(self, "kl_estimator"):
            raise RecipeValueError("kl_estimator only applies with kl_coef > 0, which is not available yet",
                                   "kl_estimator")
        if self.icepop_alpha >= self.icepop_beta:
            raise RecipeValueError(
                f"icepop_alpha ({self.icepop_alpha}) must be below icepop_beta ({self.icepop_beta})",
                "icepop_alpha", "icepop_beta")
        if self.freeze_indexer and self.indexer_loss_coef > 0:
            raise RecipeValueError(
                f"indexer_loss_coef ({self.indexer_loss_coef}) trains the indexer, but freeze_indexer is true",
                "indexer_loss_coef", "freeze_indexer")
        if self.freeze_indexer:
            raise RecipeValueError(
                "freeze_indexer (True) changes nothing: the indexers train only with indexer_loss_coef > 0 and are "
                "frozen at 0; remove it", "freeze_indexer", "indexer_loss_coef")
        if self.max_staleness == 0 and changed_keys(self, "partial_rollout"):
            raise RecipeValueError(
                f"partial_rollout ({self.partial_rollout!r}) says what happens to responses in flight at a weight "
                "push, which max_staleness 0 never has (each step's rollout ends before its push): leave it unset or "
                "set max_staleness > 0", "partial_rollout", "max_staleness")
        if self.indexer_loss_coef == 0 and (unused := changed_keys(
                self, "indexer_learning_rate", "indexer_loss_stage", "indexer_loss_target")):
            raise RecipeValueError(
                f"{unused[0]} ({getattr(self, unused[0])!r}) applies to the indexer loss, which indexer_loss_coef 0 "
                "turns off (the indexer then gets no gradient): set indexer_loss_coef > 0 or leave it unset",
                unused[0], "indexer_loss_coef")
        spec.check(self)
        return self


class MegatronSection(Section):
    """Model-parallel sizes of trainer.backend megatron; data parallel is what remains of trainer.num_workers."""

    tensor_parallel: int = Field(
        1, ge=1, description="Tensor-parallel ranks: attention heads, MLP width and vocabulary split across them, "
                             "with sequence parallelism between layers.")
    pipeline_parallel: int = Field(
        1, ge=1, description="Pipeline stages, each beginning on a layer that computes its own indexer "
                             "(IndexShare); only 1 is built yet.")
    expert_parallel: int = Field(
        1, ge=1, description="Expert-parallel ranks: the routed experts are split across them (expert tensor "
                             "parallelism is 1).")
    context_parallel: int = Field(1, ge=1, description="Context-parallel ranks; only 1 is built yet.")


class DeepSpeedSection(Section):
    """DeepSpeed ZeRO (trainer.backend deepspeed): what the workers partition, and what lives in host memory."""

    zero_stage: Literal[1, 2, 3] = Field(
        3, description="ZeRO stage: 1 partitions the optimizer state (and float32 master weights) across workers, 2 "
                       "also the gradients, 3 also the parameters, which are gathered layer by layer in forward and "
                       "backward (memory / num_workers for all three, as FSDP2's).")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="Where the optimizer state and float32 master weights live: none = on the device; cpu = "
                            "in host memory, and the optimizer step runs on the host (torch's AdamW unless cpu_adam).")
    offload_param: Literal["none", "cpu"] = Field(
        "none", description="zero_stage 3: where the parameters' partitions live between uses: none = on the "
                            "device; cpu = in host memory, copied to the device layer by layer as it runs (the "
                            "device then holds about one layer's weights: models larger than the device).")
    cpu_adam: bool = Field(
        False, description="offload_optimizer cpu: DeepSpeed's CPU Adam (vectorised C++, several times faster than "
                           "torch's AdamW on the host) instead of torch's AdamW. It is compiled on first use (about "
                           "45 s, cached in TORCH_EXTENSIONS_DIR), so it is off by default.")
    param_persistence_threshold: int = Field(
        100_000, ge=0, description="zero_stage 3: parameters with fewer elements than this stay whole on every worker "
                                   "(norms, biases, routers: a gather per use costs more than they weigh); 0 = "
                                   "partition every parameter (DeepSpeed's stage3_param_persistence_threshold).")
    prefetch_bucket_size: int = Field(
        50_000_000, ge=0, description="zero_stage 3: elements of parameters gathered ahead of the layer that needs "
                                      "them (DeepSpeed's stage3_prefetch_bucket_size); 0 = no prefetch.")
    reduce_bucket_size: int = Field(
        500_000_000, ge=1, description="Elements of gradients reduced per collective: larger buckets mean fewer "
                                       "collectives and more memory (DeepSpeed's reduce_bucket_size).")

    @model_validator(mode="after")
    def _check(self) -> DeepSpeedSection:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise RecipeValueError(f"offload_param '{self.offload_param}' needs zero_stage 3 (stages 1 and 2 keep "
                                   f"whole parameters on every worker), got {self.zero_stage}", "offload_param",
                                   "zero_stage")
        if self.cpu_adam and self.offload_optimizer == "none":
            raise RecipeValueError("cpu_adam runs the optimizer step on the host: it needs offload_optimizer 'cpu'",
                                   "cpu_adam", "offload_optimizer")
        stage3_keys = changed_keys(self, "param_persistence_threshold", "prefetch_bucket_size")
        if self.zero_stage != 3 and stage3_keys:
            raise RecipeValueError(f"{stage3_keys[0]} applies to zero_stage 3, which partitions parameters; got "
                                   f"zero_stage {self.zero_stage}", stage3_keys[0], "zero_stage")
        return self


class TrainerSection(Section):
    """The training backend and the optimiser."""

    backend: str = Field(
        "fsdp", description="Training backend: fsdp (torch FSDP2; gloo on CPU, NCCL on GPU), megatron (megatron-core "
                            "with tensor and expert parallelism: trainer.megatron) or deepspeed (DeepSpeed ZeRO 1/2/3 "
                            "with optional host offload: trainer.deepspeed). slime-dsa sft trains in one process with the built-in "
                            "trainer and refuses any but fsdp.")
    num_workers: int = Field(
        1, ge=1, description="Trainer worker processes (Ray actors), one per device; each trains on its share of "
                             "the batch. slime-dsa sft (one process) refuses any but 1.")
    data_parallel: Literal["fsdp", "replicate"] = Field(
        "fsdp", description="How workers split the model: fsdp shards parameters, gradients and optimizer state "
                            "with FSDP2 (memory / num_workers); replicate keeps the whole float32 model on every "
                            "worker and averages gradients with one all-reduce per optimizer step (faster for a "
                            "model that fits one device, e.g. the CPU quickstart; no bf16 mixed precision). slime-dsa sft (one "
                            "process) refuses replicate.")
    learning_rate: float = Field(1e-6, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.999), strict=False, description="AdamW (beta1, beta2).")
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear learning-rate warm-up from 0 to learning_rate.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning rate after warm-up: constant, or cosine/linear decay to 0 at the last "
                                "optimizer step.")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this value; 0 = no clipping.")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Token budget of one packed micro-batch (one forward/backward); sequences are "
                                "packed whole, without padding, up to it (a longer one is a micro-batch alone), and "
                                "an optimizer step accumulates the gradients of its micro-batches. slime-dsa sft "
                                "splits each step's sft.batch_size examples the same way.")
    num_steps_per_rollout: int = Field(
        1, ge=1, description="Optimizer steps per RL step: the step's samples are split into this many "
                             "mini-batches. slime-dsa sft refuses any but 1.")
    mixed_precision: bool = Field(
        False, description="Compute in bfloat16 while keeping float32 master weights and optimizer state (fsdp: "
                            "on any device; megatron and deepspeed: GPU trainers only; slime-dsa sft: bf16 autocast "
                            "on a GPU, float32 on a CPU).")
    compile: bool = Field(
        False, description="torch.compile each decoder layer of the trained models (torchtitan's per-block compile, "
                           "before FSDP2 wraps them): the norms, RoPE, projections and MoE routing between the DSA "
                           "kernels, which stay eager (a graph break at each), run as fused kernels, fewer launches "
                           "for a launch-bound GPU step. Shapes are dynamic: packs of new lengths reuse the graphs. "
                           "The compile runs in a GPU rank's kernel warm-up at start-up (perf/trainer_compiles "
                           "counts what a step compiles after it, with a warning), else in the first train call "
                           "(on a CPU: ~3 minutes at the tiny preset, for steps 1.3-1.6x faster there; on one H100: "
                           "~1 minute, for train calls 1.2-1.3x faster, benchmarks/RESULTS.md). Cost: the trainer's "
                           "log-probs no longer equal the engines' bit for bit (fused kernels round differently: "
                           "|Δlogp| ~2.5-8e-3 on one H100, where eager was 0 on the quickstart policy and 6e-4 on the small "
                           "preset's countdown policy). fsdp backend only; not "
                           "with model.true_on_policy, whose bit-equality with the engines needs their unfused "
                           "kernels. Not read by slime-dsa sft (refused set).")
    share_prompt_prefix: bool = Field(
        True, description="Run each prompt once for the samples of its group (their responses attend to the "
                          "shared prompt rows): same loss and gradients, fewer tokens computed. Off, or with "
                          "index replay, the indexer loss or the top-k mismatch metric, every sample is packed "
                          "whole.")
    num_steps: int = Field(
        100, ge=1, description="RL steps to run; each generates a batch, then takes num_steps_per_rollout "
                               "optimizer steps. slime-dsa sft: its optimizer steps.")
    seed: int = Field(42, description="Seed for random initialisation and trainer-side randomness.")
    megatron: MegatronSection = Field(
        default_factory=MegatronSection, description="Parallel sizes for trainer.backend megatron.")
    logprob_diff_warn_threshold: float = Field(
        0.05, ge=0, description="Warn when a step's mean |trainer − rollout log-prob| "
                                "(train_rollout_logprob_abs_diff) exceeds this; a jump usually means a weight-sync "
                                "error. Not read by slime-dsa sft nor by algorithms without π_old (async_reinforce, "
                                "sao), which refuse it set.")
    deepspeed: DeepSpeedSection = Field(
        default_factory=DeepSpeedSection, description="DeepSpeed ZeRO settings (backend deepspeed).")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, backend: str) -> str:
        if backend in PLANNED_TRAINER_BACKENDS:
            raise RecipeValueError(f"'{backend}' ({PLANNED_TRAINER_BACKENDS[backend]}) is not available yet; choose "
                                   f"one of {', '.join(TRAINER_BACKENDS)}")
        if backend not in TRAINER_BACKENDS:
            raise RecipeValueError(f"unknown backend '{backend}'; choose one of {', '.join(TRAINER_BACKENDS)}")
        return backend

    @field_validator("adam_betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise RecipeValueError(f"both betas must be in [0, 1), got {list(betas)}")
        return betas

    def backend_options(self) -> dict:
        """The chosen backend's own section (trainer.<backend>) as plain data; {} for a backend without one."""
        section = getattr(self, self.backend, None)
        return section.model_dump() if isinstance(section, Section) else {}

    @model_validator(mode="after")
    def _check(self) -> TrainerSection:
        changed = changed_keys(self.deepspeed, *DeepSpeedSection.model_fields)
        if changed and self.backend != "deepspeed":
            raise RecipeValueError(f"deepspeed.{changed[0]} applies to backend 'deepspeed', but backend is "
                                   f"'{self.backend}'", f"deepspeed.{changed[0]}", "backend")
        if self.backend == "deepspeed" and self.data_parallel != "fsdp":
            raise RecipeValueError(f"data_parallel '{self.data_parallel}' applies to backend 'fsdp'; DeepSpeed "
                                   "partitions by deepspeed.zero_stage", "data_parallel", "backend")
        if self.compile and self.backend != "fsdp":
            raise RecipeValueError(f"compile is built for backend 'fsdp' only, not '{self.backend}'", "compile",
                                   "backend")
        if self.backend == "megatron" and self.data_parallel != "fsdp":
            raise RecipeValueError(f"data_parallel '{self.data_parallel}' applies to backend 'fsdp'; Megatron splits "
                                   "by trainer.megatron's sizes", "data_parallel", "backend")
        total = self.num_steps * self.num_steps_per_rollout
        if self.warmup_steps > total:
            raise RecipeValueError(
                f"warmup_steps ({self.warmup_steps}) exceeds the run's {total} optimizer steps (num_steps × "
                f"num_steps_per_rollout): set trainer.warmup_steps to {total} or fewer", "warmup_steps", "num_steps")
        mg = self.megatron
        if mg != MegatronSection() and self.backend != "megatron":
            raise RecipeValueError(f"trainer.megatron is read only by backend 'megatron', but backend is "
                                   f"'{self.backend}'", "megatron", "backend")
        for key in ("pipeline_parallel", "context_parallel"):
            if getattr(mg, key) > 1:
                raise RecipeValueError(f"trainer.megatron.{key} ({getattr(mg, key)}) > 1 is not built yet",
                                       f"megatron.{key}")
        if self.num_workers % mg.tensor_parallel or self.num_workers % mg.expert_parallel:
            raise RecipeValueError(
                f"num_workers ({self.num_workers}) must be a multiple of megatron.tensor_parallel "
                f"({mg.tensor_parallel}) and megatron.expert_parallel ({mg.expert_parallel})", "num_workers",
                "megatron.tensor_parallel", "megatron.expert_parallel")
        return self


class ClusterSection(Section):
    """Where actors run: the Ray cluster, placement and resources per actor (train; slime-dsa sft refuses them set)."""

    address: str | None = Field(
        None, description="Ray cluster: null starts a local one (ray.init()); auto, the head's host:port (as "
                          "`ray start --head` printed) or ray://host:port joins a running one, whose nodes may all "
                          "take actors (model.path, the run and checkpoint directories at the same paths on each).")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="colocated: engines and trainers share devices and take turns; disaggregated: "
                                 "they do not take turns, so generation overlaps training (the asynchronous loop): "
                                 "on devices of their own, or sharing one GPU by fractions "
                                 "(recipes/gpu_single_async.yaml).")
    num_gpus_per_engine: float = Field(
        0.0, ge=0, description="GPUs per engine actor; 0 = CPU; fractions share one GPU.")
    num_gpus_per_trainer: float = Field(
        0.0, ge=0, description="GPUs per trainer worker; 0 = CPU; fractions share one GPU.")
    num_cpus_per_actor: float = Field(
        1.0, gt=0, description="CPU cores Ray reserves for each engine and trainer actor.")
    pin_cpus: Literal["auto", "on", "off"] = Field(
        "auto", description="Pin each embedded engine and trainer worker to cores of its own (num_cpus_per_actor "
                            "each) on a local Ray cluster: auto = when the asynchronous loop runs them at the same "
                            "time on CPU (the synchronous loop leaves them free to share every core: they take "
                            "turns); on = always; off = never. Skipped when the machine has too few cores.")
    engine_kv_cache_in_training: Literal["auto", "release", "keep"] = Field(
        "auto", description="Colocated on GPUs: what the engines do with their KV cache while the trainer steps. "
                            "release = free it, and an embedded engine's decode CUDA graphs with it (they are "
                            "captured again in the next rollout); keep = hold it, graphs and the engine's cached "
                            "memory with it (nothing re-allocated or captured again; the trainer has that much less "
                            "memory); auto = keep when every embedded engine's KV cache is at most 10% of its GPU's "
                            "memory, else release.")
    trainer_cache_in_rollout: Literal["auto", "release", "keep"] = Field(
        "auto", description="Colocated on GPUs: what the trainers do with their allocator's cached memory while the "
                            "engines generate. release = give it back to the device after every training call (the "
                            "next call allocates it again); keep = hold it (the engines have that much less memory); "
                            "auto = keep while the engines keep their KV cache and at least 15% of the GPU's memory is "
                            "free, else release.")

    @field_validator("pin_cpus", mode="before")
    @classmethod
    def _on_off_are_words(cls, value: object) -> object:
        """YAML 1.1 reads a bare `on` / `off` as true / false: take them as the words."""
        return {True: "on", False: "off"}[value] if isinstance(value, bool) else value

    def engines_take_turns(self) -> bool:
        """Whether the engines pause for every train call: colocated with the trainers on GPUs (colocation.py)."""
        return self.placement == "colocated" and self.num_gpus_per_engine > 0


class LoggingSection(Section):
    """Where a run writes its logs and metrics, and how often."""

    run_dir: str | None = Field(
        None, description="Directory of the run's logs, metrics.jsonl and resolved recipe; null = "
                          "runs/<run_name>.")
    project: str = Field("slime-dsa", description="W&B project name.")
    run_name: str | None = Field(None, description="Name of the run in W&B and in run_dir; null = the run directory's "
                                                   "name (run-<timestamp> when logging.run_dir is null too).")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="W&B mode; auto = online when WANDB_API_KEY is set, else offline.")
    log_every: int = Field(1, ge=1, description="Log metrics every this many RL steps (and the steps that evaluate, "
                                                "and the last); metrics that cost real compute (the DSA indexer's "
                                                "dense recall) are computed only every this many.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate on the held-out prompts every this many RL steps; 0 = never. slime-dsa "
                             "sft evaluates every sft.eval_every steps instead and refuses this key set.")
    eval_at_start: bool = Field(
        True, description="With eval_every: also evaluate the starting policy before the first step (logged as "
                          "step 0; not repeated on resume), so curves start where training did. Not read by slime-dsa sft "
                          "(refused set).")
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak dense TFLOP/s of one trainer device at the training precision, the denominator "
                                "of perf/train_mfu; null = looked up from the GPU's name (H100, H200, A100, L40S: "
                                "bf16 with trainer.mixed_precision, else fp32), and no perf/train_mfu on a CPU or "
                                "another GPU (perf/train_model_tflops is logged either way). Not read by slime-dsa sft "
                                "(refused set).")
    profile_steps: list[int] = Field(
        default_factory=list,
        description="RL steps (1-based) to record with torch.profiler in every engine and trainer rank: each writes "
                    "<run_dir>/profile/step_<N>/ with one trace per process (CPU ops and GPU kernels, for Perfetto or "
                    "chrome://tracing) and the orchestrator's phase times, and logs the step's GPU-busy share; "
                    "`python -m slime_dsa.logging.timeline <dir>` lists where the GPU sat idle. A profiled step runs "
                    "slower. Synchronous loop only (not slime-dsa sft, which refuses it set); [] = none.")
    profile_activities: list[Literal["CPU", "GPU"]] = Field(
        default_factory=lambda: ["CPU", "GPU"],
        description="What logging.profile_steps records: CPU = each engine thread's and trainer rank's ops and named "
                    "ranges (engine.step, train.forward, ...), which slow a host-bound step several times over; GPU = "
                    "every kernel and copy, whose timeline stays close to an unprofiled step's (SGLang's activities "
                    "names). Not read by slime-dsa sft (refused set).")

    @field_validator("profile_steps")
    @classmethod
    def _check_profile_steps(cls, steps: list[int]) -> list[int]:
        if any(s < 1 for s in steps):
            raise ValueError(f"steps are counted from 1, got {sorted(steps)}")
        if len(set(steps)) != len(steps):
            raise ValueError(f"a step is listed twice: {steps}")
        return sorted(steps)

    @field_validator("profile_activities")
    @classmethod
    def _check_profile_activities(cls, activities: list[str]) -> list[str]:
        if not activities or len(set(activities)) != len(activities):
            raise ValueError(f"list CPU, GPU or both, once each; got {activities}")
        return activities

    @model_validator(mode="after")
    def _check(self) -> LoggingSection:
        if changed_keys(self, "profile_activities") and not self.profile_steps:
            raise RecipeValueError(f"profile_activities ({self.profile_activities}) applies with profile_steps, "
                                   "which lists no step", "profile_activities", "profile_steps")
        return self


class CheckpointSection(Section):
    """Training checkpoints: how often, how many, and resuming (train; slime-dsa sft writes none, refuses them set)."""

    save_every: int = Field(
        0, ge=0, description="Save a training checkpoint every this many RL steps; 0 = only at the end.")
    keep_last: int = Field(2, ge=0, description="Keep the newest this many checkpoints; 0 = keep all.")
    resume: bool = Field(
        False, description="Resume from the newest checkpoint in checkpoint.dir; start fresh when there is none "
                           "(refused when there are only damaged ones).")
    dir: str | None = Field(None, description="Checkpoint directory; null = <run_dir>/checkpoints.")


class SFTSection(Section):
    """Supervised fine-tuning (`slime-dsa sft`): teaches a model the tasks' reference solutions before RL, in one process.

    sft also reads model, data, rollout.max_response_length, stop and reward_timeout_s (its evaluation), logging's
    run_dir, project, run_name, wandb_mode and log_every, and trainer's optimiser keys, micro_batch_tokens,
    mixed_precision, num_steps and seed; the keys of train's workers, cluster and checkpoints that it does not read are refused when set
    (slime_dsa/config/sft.py; `slime-dsa recipe check --for sft`).
    """

    output_dir: str | None = Field(
        None, description="Where the fine-tuned HF model directory is written; null = <run_dir>/sft_model.")
    batch_size: int = Field(64, ge=1, description="Examples (prompt + solution) per optimizer step.")
    eval_every: int = Field(100, ge=0, description="Greedy eval on held-out prompts every this many steps; 0 = at the end only. "
                          "It decodes with the float32 master weights, whatever model.dtype.")
    eval_prompts: int = Field(256, ge=1, description="Held-out prompts per eval (from each task's eval split).")
    stop_at_pass: float | None = Field(
        None, gt=0, le=1, description="Stop as soon as eval pass@1 reaches this (e.g. 0.25 to make a weak starting "
                                      "policy for RL; needs eval_every > 0); null = run trainer.num_steps.")

    @model_validator(mode="after")
    def _check(self) -> SFTSection:
        if self.stop_at_pass is not None and self.eval_every == 0:
            raise RecipeValueError(f"stop_at_pass ({self.stop_at_pass}) is checked at each evaluation, and eval_every "
                                   "0 evaluates only after the last step", "stop_at_pass", "eval_every")
        return self


class IndexerWarmupSection(Section):
    """Dense indexer warm-up (`slime-dsa indexer-warmup`): makes a dense checkpoint a DSA model (indexers only)."""

    output_dir: str | None = Field(
        None, description="Where the warmed-up HF model directory is written; null = <run_dir>/dsa_model.")
    corpus: Literal["tasks", "dataset"] = Field(
        "tasks", description="Training text: tasks = the recipe's data.tasks prompts with their reference solutions; "
                             "dataset = the text_column of dataset_path.")
    dataset_path: str | None = Field(
        None, description="Hugging Face dataset id or local jsonl/json/parquet file (corpus dataset).")
    dataset_split: str = Field("train", description="Split of dataset_path to read (corpus dataset).")
    text_column: str = Field("text", description="Column of dataset_path holding the text (corpus dataset).")
    seq_len: int = Field(256, ge=2, description="Tokens per training window; documents are concatenated and cut.")
    batch_size: int = Field(8, ge=1, description="Windows per optimizer step (packed into one forward).")
    num_steps: int = Field(200, ge=1, description="Optimizer steps of the warm-up.")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate of the indexers (nothing else trains).")
    index_topk: int | None = Field(
        None, ge=1, description="Sparse budget the indexers are warmed up and evaluated for, and written to the "
                                "output config; null = the model's index_topk.")
    reinit_indexers: bool = Field(
        False, description="Start from freshly initialised indexers (a dense checkpoint whose indexers were never "
                           "trained).")
    target: Literal["group", "own"] = Field(
        "group", description="group = each indexer learns the mean attention of its IndexShare group; own = its own "
                             "layer only.")
    eval_sequences: int = Field(
        16, ge=1, description="Windows for the recall / KL / LM-loss evaluation: corpus tasks cuts them from the "
                              "tasks' held-out prompts (eval_size, eval_fraction) with their solutions, a prompt of each "
                              "task in turn (too few held-out tokens for them is refused at the start; no task with "
                              "held-out prompts: no evaluation, and this key and eval_every set are refused); corpus "
                              "dataset evaluates on the first windows of dataset_path (trained on again once the "
                              "warm-up wraps around the file).")
    eval_every: int = Field(50, ge=0, description="Evaluate every this many steps; 0 = only before and after.")

    @model_validator(mode="after")
    def _check(self) -> IndexerWarmupSection:
        if self.corpus == "dataset" and not self.dataset_path:
            raise RecipeValueError("corpus 'dataset' needs dataset_path", "dataset_path", "corpus")
        dataset_keys = changed_keys(self, "dataset_path", "dataset_split", "text_column")
        if self.corpus != "dataset" and dataset_keys:
            key = dataset_keys[0]
            raise RecipeValueError(f"{key} ('{getattr(self, key)}') is only read by corpus 'dataset', but corpus is "
                                   f"'{self.corpus}'", key, "corpus")
        if self.index_topk is not None and self.index_topk >= self.seq_len:
            raise RecipeValueError(
                f"index_topk ({self.index_topk}) must be below seq_len ({self.seq_len}): at or above it every key is "
                "selected", "index_topk", "seq_len")
        return self


class CriticSection(Section):
    """The value model of algorithms with a critic (sao): its starting weights, optimiser and placement."""

    path: str | None = Field(
        None, description="Directory the value model starts from: a value model (a value pre-training run's "
                          "checkpoints/step_N/critic, recipes/value_pretrain.yaml) or a policy (its backbone under a "
                          "fresh value head). Default null: the policy's starting weights (model.path) under a fresh "
                          "head, as in the SAO paper.")
    learning_rate: float = Field(
        5e-6, gt=0, description="The critic's own AdamW learning rate, constant (trainer.learning_rate is the "
                                "actor's). Default 5e-6: public SAO reproductions (5e-6 against the actor's 1e-6).")
    weight_decay: float = Field(0.0, ge=0, description="The critic's AdamW decoupled weight decay. Default 0: ours.")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Clip the critic's global gradient norm to this value; 0 = no clipping. Default 1.0: "
                               "ours, as the actor's.")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: the critic lives in the policy's trainer workers (same devices; critic "
                                 "and actor train in turn); separate: in critic.num_workers workers of its own "
                                 "(critic.num_gpus_per_worker each), which train the critic while the policy "
                                 "trains. Default colocated: ours (one device holds both on the CPU and one-GPU "
                                 "recipes).")
    num_workers: int = Field(
        1, ge=1, description="placement separate: the critic's trainer workers (Ray actors, one per device). "
                             "Default 1: ours.")
    num_gpus_per_worker: float = Field(
        0.0, ge=0, description="placement separate: GPUs per critic worker; 0 = CPU. Default 0: ours (the CPU "
                               "default of every recipe).")


class RecipeConfig(Section):
    """A whole recipe. An empty one is valid and trains a tiny random model on a laptop CPU."""

    model: ModelSection = Field(default_factory=ModelSection, description="The policy model.")
    data: DataSection = Field(default_factory=DataSection, description="Prompt tasks and their mixture.")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="Generation engines and sampling.")
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection, description="The RL objective.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Training backend and optimiser.")
    critic: CriticSection = Field(
        default_factory=CriticSection, description="The value model of algorithms with a critic (sao).")
    teachers: list[TeacherConfig] = Field(
        default_factory=list, description="Expert models that score the student's samples, each owning some domains "
                                          "(tasks), for algorithms whose advantages come from a teacher (opd).")
    cluster: ClusterSection = Field(default_factory=ClusterSection, description="Ray cluster and placement.")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Run directory, W&B, cadence.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="Training checkpoints.")
    sft: SFTSection = Field(default_factory=SFTSection, description="Supervised fine-tuning (slime-dsa sft).")
    indexer_warmup: IndexerWarmupSection = Field(
        default_factory=IndexerWarmupSection, description="Dense DSA indexer warm-up (slime-dsa indexer-warmup).")

    @model_validator(mode="after")
    def _check(self) -> RecipeConfig:
        alg, ro, cl = self.algorithm, self.rollout, self.cluster
        self._check_critic()
        check_teachers(self)
        if self.trainer.backend == "megatron" and "critic" in algorithm_class(alg.name).roles:
            raise RecipeValueError(f"algorithm '{alg.name}' trains a value model, which trainer.backend megatron does "
                                   "not build yet; use fsdp", "trainer.backend", "algorithm.name")
        if self.trainer.backend == "megatron" and alg.name == "opd" and alg.opd_topk > 0:
            raise RecipeValueError("algorithm.opd_topk needs the policy's log-probs at the teachers' top-k ids, which "
                                   "trainer.backend megatron does not compute yet; use fsdp or deepspeed, or opd_topk 0",
                                   "algorithm.opd_topk", "trainer.backend")
        if (changed_keys(self.trainer, "logprob_diff_warn_threshold")
                and algorithm_class(alg.name)(alg).old_logprobs == "none"):
            raise RecipeValueError(
                f"trainer.logprob_diff_warn_threshold is not read with algorithm '{alg.name}': without π_old its "
                "|trainer − rollout log-prob| mixes staleness with the weight-sync gap, so no step is checked; "
                "leave it unset", "trainer.logprob_diff_warn_threshold", "algorithm.name")
        min_group = algorithm_class(alg.name).min_group_size
        if ro.n_samples_per_prompt < min_group:
            raise RecipeValueError(
                f"rollout.n_samples_per_prompt ({ro.n_samples_per_prompt}) must be at least {min_group} for algorithm "
                f"'{alg.name}': a group of one sample has zero advantage",
                "rollout.n_samples_per_prompt", "algorithm.name")
        if ro.dynamic_sampling and ro.n_samples_per_prompt < 2:
            raise RecipeValueError(
                f"rollout.dynamic_sampling drops groups whose rewards agree, which every group of "
                f"rollout.n_samples_per_prompt ({ro.n_samples_per_prompt}) does",
                "rollout.dynamic_sampling", "rollout.n_samples_per_prompt")
        if alg.index_replay and not ro.return_indexer_topk:
            raise RecipeValueError(
                "algorithm.index_replay needs rollout.return_indexer_topk: true (the engines must return the "
                "indices to replay)", "algorithm.index_replay", "rollout.return_indexer_topk")
        longest = self.data.max_prompt_length + ro.max_response_length
        if self.trainer.micro_batch_tokens < longest:
            raise RecipeValueError(
                f"trainer.micro_batch_tokens ({self.trainer.micro_batch_tokens}) must hold the longest sample, "
                f"data.max_prompt_length + rollout.max_response_length = {longest}",
                "trainer.micro_batch_tokens", "data.max_prompt_length", "rollout.max_response_length")
        if ro.max_cache_tokens is not None and ro.max_cache_tokens < longest:
            raise RecipeValueError(
                f"rollout.max_cache_tokens ({ro.max_cache_tokens}) must hold one rollout, data.max_prompt_length + "
                f"rollout.max_response_length = {longest}", "rollout.max_cache_tokens", "data.max_prompt_length",
                "rollout.max_response_length")
        for i, task in enumerate(self.data.tasks):
            if task.agent is None:
                continue
            if not self.data.apply_chat_template:
                raise RecipeValueError(
                    f"data.tasks.{i} ('{task.name}') runs an agent, whose tool results are chat turns: set "
                    "data.apply_chat_template: true", f"data.tasks.{i}.agent", "data.apply_chat_template")
            turn = task.agent.max_turn_tokens
            if turn is not None and turn > ro.max_response_length:
                raise RecipeValueError(
                    f"data.tasks.{i}.agent.max_turn_tokens ({turn}) exceeds rollout.max_response_length "
                    f"({ro.max_response_length}), which caps the whole trajectory", f"data.tasks.{i}.agent.max_turn_tokens",
                    "rollout.max_response_length")
        profiled = self.logging.profile_steps
        if profiled and profiled[-1] > self.trainer.num_steps:
            raise RecipeValueError(f"logging.profile_steps lists step {profiled[-1]}, past trainer.num_steps "
                                   f"({self.trainer.num_steps})", "logging.profile_steps", "trainer.num_steps")
        if profiled and self.uses_async_loop():
            raise RecipeValueError(f"logging.profile_steps needs the synchronous loop; algorithm '{alg.name}' runs the "
                                   "asynchronous one, whose steps overlap", "logging.profile_steps", "algorithm.name")
        if ro.engine == "sglang" and cl.num_gpus_per_engine == 0:
            raise RecipeValueError("rollout.engine 'sglang' needs GPUs: set cluster.num_gpus_per_engine",
                                   "rollout.engine", "cluster.num_gpus_per_engine")
        if cl.engine_kv_cache_in_training != "auto" and not cl.engines_take_turns():
            raise RecipeValueError(
                f"cluster.engine_kv_cache_in_training ({cl.engine_kv_cache_in_training!r}) applies to engines colocated "
                "on GPUs (placement colocated, num_gpus_per_engine > 0); leave it auto",
                "cluster.engine_kv_cache_in_training", "cluster.placement")
        rounds = changed_keys(ro, "oversample_factor", "max_oversample_factor", "max_sampling_tries")
        if rounds and self.uses_async_loop():
            raise RecipeValueError(
                f"rollout.{rounds[0]} ({getattr(ro, rounds[0])}) sizes the synchronous loop's sampling rounds; "
                f"algorithm '{alg.name}' runs the asynchronous one, which replaces each dropped group as it goes",
                f"rollout.{rounds[0]}", "algorithm.name")
        if ro.prefetch_next_step and ro.engine != "embedded":
            raise RecipeValueError(f"rollout.prefetch_next_step is built for embedded engines, not rollout.engine "
                                   f"{ro.engine!r}", "rollout.prefetch_next_step", "rollout.engine")
        if ro.prefetch_next_step and self.uses_async_loop():
            raise RecipeValueError(f"rollout.prefetch_next_step applies to the synchronous loop; algorithm "
                                   f"'{alg.name}' runs the asynchronous one, which always generates ahead",
                                   "rollout.prefetch_next_step", "algorithm.name")
        if ro.coalesce_calls and ro.engine != "embedded":
            raise RecipeValueError(
                f"rollout.coalesce_calls applies to embedded engines; rollout.engine {ro.engine!r} gets one call per "
                "group", "rollout.coalesce_calls", "rollout.engine")
        if changed_keys(ro, "coalesce_max_samples") and not ro.coalesces_calls():
            raise RecipeValueError(
                f"rollout.coalesce_max_samples ({ro.coalesce_max_samples}) applies with coalesce_calls on embedded "
                "engines", "rollout.coalesce_max_samples", "rollout.coalesce_calls")
        if ro.index_key_cache_dtype != "auto" and ro.engine != "embedded":
            raise RecipeValueError(
                f"rollout.index_key_cache_dtype applies to embedded engines; rollout.engine {ro.engine!r} sets its own "
                "(SGLang: --kv-cache-dtype)", "rollout.index_key_cache_dtype", "rollout.engine")
        if ro.index_key_cache_dtype != "auto" and self.model.true_on_policy:
            raise RecipeValueError(
                "rollout.index_key_cache_dtype fp8_e4m3 scores FP8 index keys, which model.true_on_policy's "
                "batch-invariant ops do not: leave it auto", "rollout.index_key_cache_dtype", "model.true_on_policy")
        if ro.enable_torch_compile and ro.engine != "embedded":
            raise RecipeValueError(
                f"rollout.enable_torch_compile applies to embedded engines; rollout.engine {ro.engine!r} sets its own "
                "(SGLang: --enable-torch-compile)", "rollout.enable_torch_compile", "rollout.engine")
        if ro.enable_torch_compile and self.model.true_on_policy:
            raise RecipeValueError(
                "rollout.enable_torch_compile fuses ops that model.true_on_policy's batch-invariant kernels replace: "
                "turn one of them off", "rollout.enable_torch_compile", "model.true_on_policy")
        if ro.num_continuous_decode_steps is not None and ro.engine != "embedded":
            raise RecipeValueError(
                f"rollout.num_continuous_decode_steps applies to embedded engines; rollout.engine {ro.engine!r} sets "
                "its own (SGLang: --num-continuous-decode-steps)", "rollout.num_continuous_decode_steps",
                "rollout.engine")
        if ro.overlap_schedule is not None and ro.engine != "embedded":
            raise RecipeValueError(
                f"rollout.overlap_schedule applies to embedded engines; rollout.engine {ro.engine!r} sets its own "
                "(SGLang: --disable-overlap-schedule)", "rollout.overlap_schedule", "rollout.engine")
        if cl.trainer_cache_in_rollout != "auto" and not cl.engines_take_turns():
            raise RecipeValueError(
                f"cluster.trainer_cache_in_rollout ({cl.trainer_cache_in_rollout!r}) applies to trainers colocated "
                "with engines on GPUs (placement colocated, num_gpus_per_engine > 0); leave it auto",
                "cluster.trainer_cache_in_rollout", "cluster.placement")
        if cl.trainer_cache_in_rollout == "keep" and cl.engine_kv_cache_in_training == "release":
            raise RecipeValueError(
                "cluster.trainer_cache_in_rollout 'keep' with engine_kv_cache_in_training 'release': the engines take "
                "their KV cache back after each training call, so the trainer must give its cached memory back",
                "cluster.trainer_cache_in_rollout", "cluster.engine_kv_cache_in_training")
        if self.trainer.data_parallel == "replicate" and self.trainer.mixed_precision:
            raise RecipeValueError(
                "trainer.data_parallel 'replicate' trains in float32; bf16 mixed precision needs 'fsdp'",
                "trainer.data_parallel", "trainer.mixed_precision")
        if self.trainer.backend != "fsdp" and self.trainer.mixed_precision and cl.num_gpus_per_trainer == 0:
            raise RecipeValueError(
                f"trainer.mixed_precision with trainer.backend {self.trainer.backend!r} needs GPU trainers (on a CPU "
                "it trains in float32): set cluster.num_gpus_per_trainer or mixed_precision: false",
                "trainer.mixed_precision", "cluster.num_gpus_per_trainer")
        self._check_true_on_policy()
        if self.model.ops_backend == "triton" and cl.num_gpus_per_engine == 0 and cl.num_gpus_per_trainer == 0:
            raise RecipeValueError(
                "model.ops_backend 'triton' needs GPUs, but cluster.num_gpus_per_engine and "
                "cluster.num_gpus_per_trainer are 0 (slime-dsa sft takes no cluster.* key: leave auto, which is "
                "triton on a GPU; indexer-warmup runs the torch ops)", "model.ops_backend")
        if self.trainer.backend == "megatron" and ro.engine == "sglang" and (
                ro.sglang.weight_sync == "distributed"
                or (ro.sglang.weight_sync == "auto" and cl.placement == "disaggregated")):
            raise RecipeValueError("rollout.sglang.weight_sync 'distributed' (auto's choice when disaggregated) is not "
                                   "built for trainer.backend 'megatron'; use disk", "rollout.sglang.weight_sync",
                                   "trainer.backend")
        if self.trainer.backend == "megatron" and ro.weight_sync == "cuda_ipc":
            raise RecipeValueError("rollout.weight_sync 'cuda_ipc' is not built for trainer.backend 'megatron'; use "
                                   "auto, shm or http", "rollout.weight_sync", "trainer.backend")
        if ro.weight_sync == "cuda_ipc" and ro.engine != "embedded":
            raise RecipeValueError(f"rollout.weight_sync 'cuda_ipc' needs embedded engines, not rollout.engine "
                                   f"{ro.engine!r}; use auto, shm or http", "rollout.weight_sync", "rollout.engine")
        if ro.weight_sync == "cuda_ipc" and (cl.num_gpus_per_engine == 0 or cl.num_gpus_per_trainer == 0):
            raise RecipeValueError(
                "rollout.weight_sync 'cuda_ipc' needs the engines and trainer rank 0 on one GPU: cluster."
                f"num_gpus_per_engine ({cl.num_gpus_per_engine:g}) and num_gpus_per_trainer "
                f"({cl.num_gpus_per_trainer:g}) above 0", "rollout.weight_sync", "cluster.num_gpus_per_engine")
        if (self.trainer.backend == "megatron" and cl.num_gpus_per_trainer > 0
                and self.algorithm.indexer_learning_rate is not None):
            raise RecipeValueError(
                "algorithm.indexer_learning_rate is not built for megatron's DistributedOptimizer (trainer ranks on "
                "GPUs) yet: leave it null", "algorithm.indexer_learning_rate", "trainer.backend")
        if ro.sglang.weight_sync == "tensor":
            raise RecipeValueError("rollout.sglang.weight_sync 'tensor' is not available yet; use auto, distributed "
                                   "or disk", "rollout.sglang.weight_sync")
        sglang_set = [k for k in SGLangSection.model_fields if getattr(ro.sglang, k) != getattr(SGLangSection(), k)]
        if sglang_set and ro.engine != "sglang" and not any(t.serving == "sglang" for t in self.teachers):
            raise RecipeValueError(
                f"rollout.sglang.{sglang_set[0]} is read only by SGLang servers (rollout.engine 'sglang', or a teacher "
                f"serving 'sglang'), but rollout.engine is '{ro.engine}'", f"rollout.sglang.{sglang_set[0]}",
                "rollout.engine")
        if ro.engine == "sglang" and ro.weight_sync != "auto":
            raise RecipeValueError(
                f"rollout.weight_sync '{ro.weight_sync}' is for embedded and external engines; SGLang servers take "
                "rollout.sglang.weight_sync", "rollout.weight_sync", "rollout.engine")
        if self.logging.eval_every > 0 and not any(t.has_eval_split for t in self.data.tasks):
            raise RecipeValueError(
                f"logging.eval_every ({self.logging.eval_every}) needs held-out prompts: set eval_size or "
                "eval_fraction on a task in data.tasks", "logging.eval_every")
        if self.sft.stop_at_pass is not None and not any(t.has_eval_split for t in self.data.tasks):
            raise RecipeValueError(  # else eval pass@1 is nan at every eval and the stop never comes
                f"sft.stop_at_pass ({self.sft.stop_at_pass}) needs held-out prompts: set eval_size or eval_fraction "
                "on a task in data.tasks", "sft.stop_at_pass")
        sft_eval = [k for k in changed_keys(self.sft, "eval_every", "eval_prompts") if getattr(self.sft, k)]
        if sft_eval and not any(t.has_eval_split for t in self.data.tasks):  # else every evaluation scores nothing
            raise RecipeValueError(
                f"sft.{sft_eval[0]} ({getattr(self.sft, sft_eval[0])}) needs held-out prompts: set eval_size or "
                "eval_fraction on a task in data.tasks", f"sft.{sft_eval[0]}")
        iw = self.indexer_warmup
        iw_eval = [k for k in changed_keys(iw, "eval_every", "eval_sequences") if getattr(iw, k)]
        if iw.corpus == "tasks" and iw_eval and not any(t.has_eval_split for t in self.data.tasks):
            raise RecipeValueError(  # else the warm-up evaluates nothing: its windows come from the eval splits
                f"indexer_warmup.{iw_eval[0]} ({getattr(iw, iw_eval[0])}) needs held-out prompts with corpus 'tasks': "
                "set eval_size or eval_fraction on a task in data.tasks", f"indexer_warmup.{iw_eval[0]}")
        if self.checkpoint.resume and not (self.checkpoint.dir or self.logging.run_dir or self.logging.run_name):
            raise RecipeValueError(
                "checkpoint.resume needs a fixed place to resume from: set checkpoint.dir, logging.run_dir or "
                "logging.run_name (the default run name is new on every run)", "checkpoint.resume")
        if ro.engine == "external" and cl.engines_take_turns():  # the pauses and releases go to servers not ours
            raise RecipeValueError(
                f"cluster.num_gpus_per_engine ({cl.num_gpus_per_engine:g}) with placement 'colocated' makes the "
                "engines take turns with the trainers (paused, their KV cache released, for every train call), and "
                "rollout.engine 'external' servers are not the run's to pause: set cluster.num_gpus_per_engine 0 "
                "(such servers hold their own GPUs) or cluster.placement 'disaggregated'",
                "cluster.num_gpus_per_engine", "rollout.engine")
        return self

    def _check_true_on_policy(self) -> None:
        """model.true_on_policy only where engine and trainer run the batch-invariant ops (issue 23)."""
        if not self.model.true_on_policy:
            return
        ro, cl, tr = self.rollout, self.cluster, self.trainer
        engine_bf16 = self.model.dtype == "bfloat16" or (self.model.dtype == "auto" and cl.num_gpus_per_engine > 0)
        refusals = [
            (tr.backend != "fsdp", f"is built for trainer.backend 'fsdp' only, not {tr.backend!r}", "trainer.backend"),
            (ro.engine != "embedded", f"is built for rollout.engine 'embedded' only, not {ro.engine!r} (only the "
                                      "embedded engines the run starts run the batch-invariant ops)", "rollout.engine"),
            (engine_bf16 != tr.mixed_precision,
             f"needs engines and trainer in one dtype: the engines compute in {'bfloat16' if engine_bf16 else 'float32'}"
             f" (model.dtype {self.model.dtype}), the trainer in {'bfloat16' if tr.mixed_precision else 'float32'} "
             f"(trainer.mixed_precision {str(tr.mixed_precision).lower()})", "trainer.mixed_precision"),
            (tr.compile, "needs the trainer to run the engines' unfused batch-invariant kernels, which "
                         "trainer.compile would fuse differently: set trainer.compile false", "trainer.compile"),
            (ro.top_p < 1 or ro.top_k != -1,
             f"scores the unfiltered distribution: set rollout.top_p 1 and top_k -1 (got {ro.top_p}, {ro.top_k})",
             "rollout.top_p"),
        ]
        for refused, why, key in refusals:
            if refused:
                raise RecipeValueError(f"model.true_on_policy {why}", "model.true_on_policy", key)

    def _check_critic(self) -> None:
        """The critic section is read only by algorithms with a critic role; separate-placement keys only there."""
        critic, spec = self.critic, algorithm_class(self.algorithm.name)
        defaults = CriticSection()
        changed = [k for k in type(critic).model_fields if getattr(critic, k) != getattr(defaults, k)]
        if changed and "critic" not in spec.roles:
            readers = [name for name, other in ALGORITHMS.items() if "critic" in other.roles]
            raise RecipeValueError(
                f"critic.{changed[0]} is read only by algorithms with a value model ({', '.join(readers)}), but "
                f"algorithm.name is '{self.algorithm.name}'", f"critic.{changed[0]}", "algorithm.name")
        if critic.placement == "colocated":
            for key in ("num_workers", "num_gpus_per_worker"):
                if getattr(critic, key) != getattr(defaults, key):
                    raise RecipeValueError(
                        f"critic.{key} ({getattr(critic, key)}) applies to placement 'separate'; a colocated critic "
                        "uses the trainer's workers", f"critic.{key}", "critic.placement")

    def uses_async_loop(self) -> bool:
        """Whether the algorithm's own loop is the asynchronous one."""
        return algorithm_class(self.algorithm.name).loop == "async"

    def in_flight_samples(self, use_async: bool | None = None) -> int:
        """Samples the loop can have started and not yet trained: one step's largest round in the synchronous loop,
        max_staleness + 1 steps' in the asynchronous one (its StalenessGate). use_async None: the algorithm's loop."""
        ro = self.rollout
        use_async = self.uses_async_loop() if use_async is None else use_async
        if use_async:
            return (self.algorithm.max_staleness + 1) * ro.prompts_per_step * ro.n_samples_per_prompt
        return ro.step_samples()

    def max_concurrency(self, use_async: bool | None = None) -> int:
        """rollout.max_concurrency resolved: the recipe's value, or when null every sample the loop can have in
        flight (in_flight_samples), at least what the engines run at once (evaluation fills them)."""
        ro = self.rollout
        engines = len(ro.engine_urls) if ro.engine == "external" else ro.num_engines
        return ro.max_concurrency or max(self.in_flight_samples(use_async), ENGINE_RUNNING_REQUESTS * engines)

    def concurrency_line(self, use_async: bool | None = None) -> str:
        """One line: rollout.max_concurrency as the loop will use it, and why; a value that cannot hold one step's
        samples says what that costs."""
        ro = self.rollout
        use_async = self.uses_async_loop() if use_async is None else use_async
        loop = "asynchronous" if use_async else "synchronous"
        step = ro.step_samples()
        if ro.max_concurrency is None:
            how = (f"(max_staleness + 1 = {self.algorithm.max_staleness + 1}) steps × " if use_async else "one step: ")
            oversampled = " × max_oversample_factor" if ro.dynamic_sampling and not use_async else ""
            return (f"rollout.max_concurrency: {self.max_concurrency(use_async)} samples in flight (null: {how}"
                    f"{ro.prompts_per_step} prompts × {ro.n_samples_per_prompt} samples{oversampled}, at least "
                    f"{ENGINE_RUNNING_REQUESTS} per engine; {loop} loop)")
        if ro.max_concurrency < step:
            return (f"rollout.max_concurrency ({ro.max_concurrency}) is below one step's {step} samples: "
                    f"{step - ro.max_concurrency} wait for a free place and the step waits on their tail; "
                    "null covers the step")
        return f"rollout.max_concurrency: {ro.max_concurrency} samples in flight (set; one step has {step}; {loop} loop)"

    def summary(self) -> str:
        """One line that says what this recipe trains, on what, and how."""
        tasks = ", ".join(f"{t.name}×{t.weight:g}" for t in self.data.tasks)
        ro, tr = self.rollout, self.trainer
        engines = len(ro.engine_urls) if ro.engine == "external" else ro.num_engines
        return (f"{self.algorithm.name} on {self.model.source} | tasks: {tasks} | "
                f"{ro.prompts_per_step} prompts × {ro.n_samples_per_prompt} samples/step | "
                f"{engines} {ro.engine} engine(s) | {tr.num_workers} {tr.backend} trainer(s) | {tr.num_steps} steps")
