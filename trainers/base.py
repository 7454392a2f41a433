"""The trainer seam: the packed batch a rank trains on, the typed config it is built from, and the interface the
orchestrator calls on a group of ranks.

A backend (trainers/fsdp, trainers/deepspeed; Megatron next) supplies only model wrapping, optimizer, collectives
and checkpoint format: the step itself (micro-batches, loss reduction, indexer loss, metrics) is shared
(trainers/rank.py), and so is the fan-out over Ray actors (trainers/group.py). Ranks are blind to the algorithm:
they call the policy loss object their config carries on tensors the batch carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from slime_dsa.trace_recorder import ACTIVITIES
from slime_dsa.weights.payloads import TensorSpec

# Metrics of a whole train call, not of one optimiser step (rank 0's garbage collections, compiles and GPU busy
# share, the call's dispatch): the group keeps them out of the step average and the orchestrator logs them under perf/.
CALL_METRIC_PREFIXES = ("trainer_gc_", "trainer_dispatch_", "trainer_compiles", "trainer_gpu_")


@dataclass
class TrainBatch:
    """Samples for one rank, packed: every per-token tensor has shape (T,) over prompt+response tokens.

    Row t of `rollout_logprobs` / `advantages` / `loss_mask` describes token t (its log-prob given the tokens
    before it); prompt rows have loss_mask 0.
    """

    input_ids: torch.Tensor  # (T,) long
    seqlens: list[int]  # tokens per sample, in order
    loss_mask: torch.Tensor  # (T,) float, 1 on generated tokens the policy is trained on
    rollout_logprobs: torch.Tensor  # (T,) float32, log π_roll of each token (0 on prompt)
    advantages: torch.Tensor  # (T,) float32, the sample's advantage on each of its tokens, or one per token (GAE)
    old_logprobs: torch.Tensor | None = None  # (T,) log π_old, filled by compute_logprobs unless bypass mode
    ref_logprobs: torch.Tensor | None = None  # (T,) for the optional KL term
    replay_topk: torch.Tensor | None = None  # (n_full_layers, T, K) index replay, -1 padded, REPLAY_COMPUTE rows computed
    rollout_topk: torch.Tensor | None = None  # same layout: the engine's selection, only compared (mismatch metric)
    prompt_lens: list[int] | None = None  # prompt tokens per sample: lets consecutive samples share their prompt
    returns: torch.Tensor | None = None  # (T,) float32, a critic's value targets on action tokens
    old_values: torch.Tensor | None = None  # (T,) float32, V_old(s_t) of the critic before this step's updates
    # A target distribution known at K candidate ids per token (a teacher's top-k): the rank computes the policy's
    # log-probs at those ids and hands both to the loss (a sparse KL).
    candidate_ids: torch.Tensor | None = None  # (T, K) long, ids in the distribution over token t
    candidate_target_logprobs: torch.Tensor | None = None  # (T, K) float32, the target's log-probs at them
    candidate_mask: torch.Tensor | None = None  # (T,) float32, 1 on tokens whose loss uses them

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def __reduce__(self):
        # To a trainer rank through Ray: each CPU tensor as a byte array, which Ray's pickle 5 carries out of band
        # (no copy into the pickle, read back from the object store in place). torch's own tensor pickling copies
        # every storage through torch.save: 2.2 MB of a 64 x 16 step's batch took twice as long to arrive.
        fields = {f.name: _portable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return _rebuild_train_batch, (fields,)

    def select(self, sample_ids: list[int]) -> "TrainBatch":
        """The sub-batch of the given samples (in that order). All the samples in order: a batch sharing these
        tensors (the micro-batch of a step that fits one, the shard of a one-rank group)."""
        if list(sample_ids) == list(range(len(self.seqlens))):
            return dataclasses.replace(self, seqlens=list(self.seqlens),
                                       prompt_lens=None if self.prompt_lens is None else list(self.prompt_lens))
        rows = sample_rows(self.seqlens, sample_ids)

        def take(t: torch.Tensor | None, dim: int = 0) -> torch.Tensor | None:
            return None if t is None else t.index_select(dim, rows)

        return TrainBatch(
            input_ids=take(self.input_ids), seqlens=[self.seqlens[i] for i in sample_ids],
            loss_mask=take(self.loss_mask), rollout_logprobs=take(self.rollout_logprobs), advantages=take(self.advantages),
            old_logprobs=take(self.old_logprobs), ref_logprobs=take(self.ref_logprobs),
            replay_topk=take(self.replay_topk, dim=1), rollout_topk=take(self.rollout_topk, dim=1),
            prompt_lens=None if self.prompt_lens is None else [self.prompt_lens[i] for i in sample_ids],
            returns=take(self.returns), old_values=take(self.old_values), candidate_ids=take(self.candidate_ids),
            candidate_target_logprobs=take(self.candidate_target_logprobs), candidate_mask=take(self.candidate_mask),
        )


def _portable(value: Any) -> Any:
    """A CPU tensor as (bytes as a numpy array, dtype, shape); anything else (lists, None, device tensors) as is."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.requires_grad:
        return value
    flat = value.contiguous().reshape(-1)
    return _PortableTensor(flat.view(torch.uint8).numpy(), value.dtype, tuple(value.shape))


@dataclass(frozen=True)
class _PortableTensor:
    data: Any  # (bytes,) uint8 numpy array
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        # Read back from Ray's object store the array is read-only: copy it, so that the batch's tensors stay writable.
        data = self.data if self.data.flags.writeable else self.data.copy()
        return torch.from_numpy(data).view(self.dtype).reshape(self.shape)


def _rebuild_train_batch(fields: dict[str, Any]) -> "TrainBatch":
    return TrainBatch(**{k: v.tensor() if isinstance(v, _PortableTensor) else v for k, v in fields.items()})


def sample_rows(seqlens: list[int], sample_ids: list[int]) -> torch.Tensor:
    """(rows,) long: the packed rows of the given samples, in that order (one tensor op per step, not per sample)."""
    lengths = torch.tensor(seqlens, dtype=torch.long)
    starts = lengths.cumsum(0) - lengths  # (S,) first row of each sample
    ids = torch.tensor(sample_ids, dtype=torch.long)
    lengths, starts = lengths[ids], starts[ids]
    total = int(lengths.sum()) if len(sample_ids) else 0
    # Row j of the output is j - (rows before its sample in the output) + (its sample's first row).
    shift = starts - (lengths.cumsum(0) - lengths)
    return torch.arange(total) + torch.repeat_interleave(shift, lengths, output_size=total)


def split_by_tokens(seqlens: list[int], max_tokens: int, shared: list[int] | None = None) -> list[list[int]]:
    """Greedy packing of samples (in order) into groups of at most max_tokens (a longer sample stands alone).

    shared[i]: leading tokens sample i shares with sample i - 1; computed once when both are in one group, so
    they cost nothing there (shared-prompt packing).
    """
    groups, current, size = [], [], 0
    for i, n in enumerate(seqlens):
        cost = n - shared[i] if shared and current else n
        if current and size + cost > max_tokens:
            groups.append(current)
            current, size, cost = [], 0, n
        current.append(i)
        size += cost
    if current:
        groups.append(current)
    return groups


def balance_across_ranks(seqlens: list[int], world_size: int, shared: list[int] | None = None) -> list[list[int]]:
    """Assign samples to ranks so that the rows each computes are balanced (largest first onto the lightest rank).

    shared[i] (as in split_by_tokens): leading tokens sample i shares with sample i - 1. A run of samples that
    share their prompt stays on one rank, which computes the prompt once, unless the run alone exceeds a rank's
    fair share of the rows: then it is cut into that many pieces, each computing the prompt again.
    """
    shared = shared or [0] * len(seqlens)
    runs: list[list[int]] = []
    for i in range(len(seqlens)):
        if runs and shared[i] > 0:
            runs[-1].append(i)
        else:
            runs.append([i])

    def rows(piece: list[int]) -> int:
        return seqlens[piece[0]] + sum(seqlens[i] - shared[i] for i in piece[1:])

    fair = max(sum(rows(run) for run in runs) / world_size, 1.0)
    pieces: list[list[int]] = []
    for run in runs:
        cuts = min(len(run), -(-rows(run) // int(fair)) if rows(run) > fair else 1)
        pieces += [run[j * len(run) // cuts : (j + 1) * len(run) // cuts] for j in range(cuts)]
    loads = [0] * world_size
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for piece in sorted(pieces, key=lambda p: -rows(p)):
        rank = loads.index(min(loads))
        assignment[rank].extend(piece)
        loads[rank] += rows(piece)
    return [sorted(a) for a in assignment]


@dataclass(frozen=True)
class DSAOptions:
    """How a rank trains the DSA indexer (docs/algorithms.md section 6) and whether it replays the engines' top-k."""

    indexer_loss_coef: float = 0.0  # 0 = no indexer loss (no capture, no extra cost)
    indexer_stage: str = "sparse"  # sparse: KL on the selected keys; dense: on every causal key
    indexer_target: str = "group"  # group: mean attention of the IndexShare group; own: the full layer only
    indexer_learning_rate: float | None = None  # a separate AdamW param group for the indexers; None = the main lr
    index_replay: bool = False  # replay the engines' top-k (batch.rollout_topk) instead of only comparing with it


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 100
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0


ModelKind = Literal["policy", "value"]  # a causal LM (log-probs) or a value model (per-token values)


@dataclass(frozen=True)
class RoleConfig:
    """One model a trainer group holds (the policy, a critic; teachers next): its weights, and how it trains."""

    model_path: str  # an HF directory; for kind value a value model, or a policy whose backbone starts a fresh head
    optimizer: OptimizerConfig | None = None  # None: the role is only evaluated (a teacher, a reference)
    loss: Any = None  # the per-token loss the rank calls: a PolicyLoss (kind policy), a ValueLoss (kind value)
    frozen: tuple[str, ...] = ()  # parameters whose names contain one of these stay fixed (e.g. ".indexer.")
    dsa: DSAOptions = field(default_factory=DSAOptions)
    kind: ModelKind = "policy"

    @property
    def trains(self) -> bool:
        return self.optimizer is not None and self.loss is not None


@dataclass(frozen=True)
class RankConfig:
    """Everything a rank needs to build itself; plain data, so it crosses process boundaries."""

    roles: dict[str, RoleConfig]
    micro_batch_tokens: int = 4096
    mixed_precision: bool = False
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer (fsdp backend: trainers/fsdp/parallelize.apply_compile)
    ops_backend: str = "auto"
    true_on_policy: bool = False  # batch-invariant ops (slime_dsa.ops.invariant), as the engines run
    temperature: float = 1.0  # log-probs are of the tempered distribution the engine sampled from
    seed: int = 0
    logprob_chunk_size: int = 1024
    share_prompt_prefix: bool = True  # compute a prompt once for the consecutive samples that share it
    data_parallel: str = "fsdp"  # fsdp: shard with FSDP2; replicate: whole model per rank, one gradient all-reduce
    backend_options: dict[str, Any] = field(default_factory=dict)  # the backend's own recipe section (trainer.<backend>)
    warmup_max_len: int = 0  # the longest sample a step trains: GPU ranks compile their kernels for it at start (0: not)


def policy_config(model_path: str, loss: Any, optimizer: OptimizerConfig | None = None, frozen: tuple[str, ...] = (),
                  dsa: DSAOptions | None = None, **rank: Any) -> RankConfig:
    """A RankConfig holding one trained policy role (the common case, and the tests')."""
    role = RoleConfig(model_path, optimizer or OptimizerConfig(), loss, frozen, dsa or DSAOptions())
    return RankConfig(roles={"policy": role}, **rank)


class TrainerGroup(Protocol):
    """What the orchestrator calls on a group of training ranks. Every call reaches every rank."""

    world_size: int

    def train(self, batch: TrainBatch, num_mini_batches: int = 1, recompute_old_logprobs: bool = False,
              detailed_metrics: bool = True, role: str = "policy",
              on_sent: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, dict[str, float]]:
        """One RL step's training of `role`: π_old first when asked (a policy), then num_mini_batches optimiser
        steps. A value role trains on batch.returns (and batch.old_values, for the value clip). on_sent: called
        (from the calling thread) once the call is sent to every rank, before the wait for its answer."""

    def compute_logprobs(self, batch: TrainBatch, role: str = "policy") -> torch.Tensor:
        """(T,) log-probs of the batch's tokens under the role's current weights, in batch order."""

    def compute_values(self, batch: TrainBatch, role: str = "critic") -> tuple[torch.Tensor, torch.Tensor]:
        """A value role's (values (T,) in batch order, row t = V(s_t) before token t; final (N,) V after each
        sample's last token), float32 on the driver."""

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor]:
        """The role's whole float32 state dict on the driver (HF names)."""

    def save_weights(self, path: str, role: str = "policy") -> None:
        """Rank 0 writes the role's full state dict to the safetensors file `path`, atomically."""

    def share_weights(self, engine_dtype: str) -> dict:
        """Rank 0's CUDA IPC table of the policy's weights in one GPU buffer (engines on its GPU copy them)."""

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        """Names, dtypes and shapes of the policy's tensors in the order broadcast_weights sends them."""

    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 can host a weight-update group with the engines: (address, free port)."""

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        """Rank 0 joins the engines' weight-update group as its rank 0."""

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        """Rank 0 broadcasts the policy's tensors of `buckets` to that group."""

    def cuda_device(self) -> str | None:
        """The GPU UUID of rank 0 (None on CPU)."""

    def node_id(self) -> str | None:
        """The Ray node of rank 0."""

    def save_checkpoint(self, directory: str) -> None:
        """Every trained role, its optimizer and the ranks' RNG into `directory`."""

    def load_checkpoint(self, directory: str) -> None:
        """The inverse of save_checkpoint: training continues exactly."""

    def release_memory(self, min_free_share: float | None = None) -> None:
        """Give cached device memory back while the engines generate (colocated on a GPU); with min_free_share, only
        when less than that share of the device's memory is free."""

    def resume_memory(self) -> None:
        """Ready the device memory for the next training call."""

    def start_profile(self, directory: str, activities: Sequence[str] = ACTIVITIES) -> None:
        """Every rank records its ops (CPU) and/or kernels (GPU) with torch.profiler until stop_profile."""

    def stop_profile(self) -> list[str]:
        """Every rank writes its trace into start_profile's directory; their paths."""

    def shutdown(self) -> None:
        """Stop every rank."""
