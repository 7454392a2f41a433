"""The training step every backend shares: micro-batches, the policy loss (or a value role's loss) per micro-batch,
the indexer loss, the metrics and their reduction across ranks, and the weight-sync check.

A backend subclasses TrainerRank and supplies the rest: it builds `self.roles` (model wrapping and optimizer) and
`self.device`, and may override the collectives (`all_reduce`), gradient averaging (`finish_gradients`),
clipping (`clip_grad_norm`), and its checkpoint format; a backend whose engine owns the backward pass and the update
(DeepSpeed) overrides `backward` and `apply_gradients` instead. The rank never learns which algorithm it trains: it calls
the loss object of its role's config on the tensors the batch carries: a policy role's on log-probs, a value role's
(RoleConfig.kind "value") on the values of its model against batch.returns.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime_dsa.algorithms import LossInputs, ValueLossInputs
from slime_dsa.algorithms.is_correction import logprob_agreement_sums
from slime_dsa.algorithms.indexer_loss import dsa_indexer_loss, group_recall, topk_overlap
from slime_dsa.trace_recorder import ACTIVITIES, annotate
from slime_dsa.devices import upload, upload_many
from slime_dsa.gc_watch import GcWatch, freeze_after_startup
from slime_dsa.gpu_utilization import GpuBusyMeter
from slime_dsa.models import PackedBatch
from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE
from slime_dsa.models.prefix_sharing import pack_shared_prefixes, shared_prompt_lengths
from slime_dsa.weights.payloads import TensorSpec, bucket_specs
from trainers.base import RankConfig, RoleConfig, TrainBatch, split_by_tokens
from trainers.warmup import warmup_batches
from trainers.weight_sender import broadcast_weights, group_address, weight_specs

logger = logging.getLogger(__name__)

# Loss metrics already normalised by the step-wide denominator: their micro-batch values add up.
SHARE_METRICS = {"loss", "pg_loss", "kl_ref", "value_loss"}
# Counts of optimiser steps: one call's steps add up (the other step metrics are averaged over them).
COUNT_METRICS = {"skipped_updates"}


@dataclass
class Role:
    """A model the rank holds, with its optimizer and schedule when it trains."""

    config: RoleConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler.LRScheduler
    step: int = 0  # optimizer steps taken
    compute: torch.nn.Module | None = None  # what runs forward and backward when not `model` (a bf16 copy)

    @functools.cached_property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The model's parameters that train, listed once (walking the module tree costs ms a step at ~800 tensors)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @functools.cached_property
    def modules(self) -> tuple[torch.nn.Module, ...] | None:
        """The module tree of `runs`, listed once (as `trainable`: walking it costs ~0.7 ms a train call at ~1,000
        modules); None when `runs` is not a module."""
        return tuple(self.runs.modules()) if isinstance(self.runs, torch.nn.Module) else None

    @property
    def runs(self) -> torch.nn.Module:
        """The module the step calls: the compute copy where there is one, else the model."""
        return self.compute if self.compute is not None else self.model


@dataclass
class StepSums:
    """One optimiser step's metrics, still where they were computed (read by TrainerRank._read_steps)."""

    sums: dict[str, Metric]  # accumulated over micro-batches (see _accumulate)
    grad_norm: torch.Tensor  # the global norm before clipping
    lr: float  # the step's learning rate
    index: int  # the role's optimiser step count before it
    old_logprobs: list[torch.Tensor] | None = None  # π_old of each micro-batch, when its forward gave them


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, on_device: bool | None = None) -> None:
    """optimizer.step() unless grad_norm is not finite. On a GPU (on_device, by default when the norm is on one) a
    fused optimizer decides on the device, given the found_inf tensor torch's GradScaler hands it, so the host does
    not wait for the backward to finish to read the norm; elsewhere the host reads it."""
    on_device = grad_norm.device.type != "cpu" if on_device is None else on_device
    if on_device and getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif torch.isfinite(grad_norm):
        optimizer.step()


def shares_prompts(batch: TrainBatch, config: RankConfig, role: RoleConfig) -> bool:
    """Whether this batch trains the role with shared-prompt packing. Top-k replay, the top-k mismatch metric, the
    indexer loss and value models work on the flat layout."""
    return (config.share_prompt_prefix and role.kind == "policy" and batch.prompt_lens is not None
            and batch.replay_topk is None and batch.rollout_topk is None and role.dsa.indexer_loss_coef == 0)


def _sample_index(seqlens: list[int], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(seqlens), device=device), upload(torch.tensor(seqlens), device),
                                   output_size=sum(seqlens))


Metric = torch.Tensor | float  # a step's metrics stay on the device until the step ends: one host sync per step


def _share_metrics(metrics: dict[str, Metric], share: float) -> dict[str, Metric]:
    """A micro-batch's metrics as its token-weighted share of the step's (step-wide losses and maxima as they are)."""
    out = {}
    for key, value in metrics.items():
        value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
        out[key] = value if key in SHARE_METRICS or key.endswith("_max") else value * share
    return out


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far, recompiles included (dynamo's own counter)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - dynamo is imported only where trainer.compile is on

    return counters["frames"]["ok"]


def _accumulate(sums: dict[str, Metric], metrics: dict[str, Metric]) -> None:
    """Add a micro-batch's metrics into the step's: "_max" keys by maximum, the rest (weighted shares) by sum."""
    for key, value in metrics.items():
        if key not in sums:
            sums[key] = value
        elif key.endswith("_max"):  # a 0-dim CPU tensor meets a device one as a scalar: no copy, no sync
            sums[key] = torch.maximum(torch.as_tensor(sums[key]), torch.as_tensor(value))
        else:
            sums[key] = sums[key] + value


def combine_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One call's metrics from those of its optimiser steps: counts summed, lr the last step's, the rest averaged
    (a non-finite grad_norm stays non-finite)."""
    out = {k: sum(m[k] for m in steps) / (1 if k in COUNT_METRICS else len(steps)) for k in steps[0]}
    out["lr"] = steps[-1]["lr"]
    return out


def micro_batch_loss(loss: Any, logprobs: torch.Tensor, mb: TrainBatch, entropy: torch.Tensor | None,
                     step_loss_tokens: float, step_num_samples: int,
                     candidate_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
    """The policy loss of one micro-batch as its share of the whole step's loss, and token-weighted metrics.
    candidate_logprobs (T, K): the policy's log-probs at mb.candidate_ids, when the batch carries candidates."""
    device = logprobs.device
    sample_index = _sample_index(mb.seqlens, device)
    token_mean = loss.aggregation == "token_mean"

    with_candidates = candidate_logprobs is not None
    advantages, loss_mask, old_logprobs, rollout_logprobs, ref_logprobs, candidate_targets, candidate_mask = upload_many(
        [mb.advantages, mb.loss_mask, mb.old_logprobs, mb.rollout_logprobs, mb.ref_logprobs,
         mb.candidate_target_logprobs if with_candidates else None, mb.candidate_mask if with_candidates else None],
        device)
    inputs = LossInputs(
        logprobs=logprobs, advantages=advantages, loss_mask=loss_mask.float(), sample_index=sample_index,
        old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
        candidate_logprobs=candidate_logprobs, candidate_target_logprobs=candidate_targets,
        candidate_mask=candidate_mask,
        denominator=max(step_loss_tokens, 1.0) if token_mean else max(step_num_samples, 1),
    )
    out = loss(inputs)
    share = float(mb.loss_mask.sum()) / max(step_loss_tokens, 1.0)  # this micro-batch's share of the step's tokens
    return out.loss, _share_metrics(out.metrics, share)


def micro_batch_value_loss(loss: Any, values: torch.Tensor, mb: TrainBatch, step_loss_tokens: float,
                           step_num_samples: int) -> tuple[torch.Tensor, dict[str, Metric]]:
    """A value role's loss on one micro-batch (values (T,) V(s_t) of its model) as its share of the step's loss."""
    if mb.returns is None:
        raise ValueError("a value role trains on batch.returns, which this batch lacks")
    device = values.device
    old = mb.old_values if mb.old_values is not None else values.detach()
    inputs = ValueLossInputs(
        values=values, old_values=upload(old, device), returns=upload(mb.returns, device),
        loss_mask=upload(mb.loss_mask, device).float(), sample_index=_sample_index(mb.seqlens, device),
        denominator=max(step_loss_tokens, 1.0) if loss.aggregation == "token_mean" else max(step_num_samples, 1),
    )
    out = loss(inputs)
    return out.loss, _share_metrics(out.metrics, float(mb.loss_mask.sum()) / max(step_loss_tokens, 1.0))


class TrainerRank:
    """One training rank. Call every collective method on every rank of the group."""

    # Whether the model's forward computes the same log-probs with autograd as without, bit for bit, so that the first
    # step's forward gives π_old (train_batches then skips the π_old pass of the first mini-batch). A backend sets it
    # where a test shows it (tests/test_rank_step.py for FSDP, on CPU and on the GPU).
    reuses_first_forward: bool = False
    # Whether warm_up may run a forward and backward outside a step: where backward only adds into gradients that
    # zero_gradients clears (not where an engine owns the backward and the update, as DeepSpeed's does).
    warms_up_kernels: bool = False

    def __init__(self, rank: int, world_size: int, config: RankConfig) -> None:
        self.rank, self.world_size, self.config = rank, world_size, config
        # Where this rank's samples come from: ranks of one data-parallel rank (tensor-parallel peers) share a shard.
        self.data_parallel_rank, self.data_parallel_size = rank, world_size
        self.device = torch.device("cpu")
        self.roles: dict[str, Role] = {}  # built by the backend
        self._weight_group = None  # rank 0's group with the engines, joined by join_weight_group (distributed sync)
        self._recorder = None  # a TraceRecorder once start_profile ran
        self._gc_watch: GcWatch | None = None  # once watch_garbage_collector ran (a Ray actor's own process)
        self._kernels_warmed = False  # warm_up compiled the kernels: a later compile is a miss, logged
        self._gpu_meter: GpuBusyMeter | None = None  # rank 0 on a GPU, opened at its first train call
        self._gpu_meter_opened = False

    @property
    def policy(self) -> Role:
        return self.roles["policy"]

    def data_parallel_layout(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): the group splits the batch by it."""
        return self.data_parallel_rank, self.data_parallel_size

    # -- placement and memory, the same for every backend ----------------------------------------------------

    def cuda_device(self) -> str | None:
        """The UUID of this rank's GPU (None on CPU): engines with the same UUID share its memory."""
        from slime_dsa.weights.cuda_ipc import device_uuid  # noqa: PLC0415

        return device_uuid(self.device) if self.device.type == "cuda" else None

    def node_id(self) -> str | None:
        """The Ray node this rank runs on (None outside Ray)."""
        import ray  # noqa: PLC0415

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def release_memory(self, min_free_share: float | None = None) -> None:
        """Return the allocator's cached blocks to the device, so colocated engines can use them while they generate;
        with min_free_share, only when less than that share of the device's memory is free. Kept blocks spare the
        next training call its allocations (cudaMalloc) and this call its frees, which wait for the device."""
        if self.device.type != "cuda":
            return
        if min_free_share is not None:
            free, total = torch.cuda.mem_get_info(self.device)
            if free >= min_free_share * total:
                return
        torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Nothing to bring back: the weights and optimizer state stay where the backend keeps them."""

    def start_profile(self, directory: str, activities: Sequence[str] = ACTIVITIES) -> None:
        """Record this rank's ops and/or kernels with torch.profiler until stop_profile (logging.profile_steps)."""
        from slime_dsa.trace_recorder import TraceRecorder  # noqa: PLC0415

        self._recorder = self._recorder or TraceRecorder()
        self._recorder.start(directory, f"trainer-rank{self.rank}", activities)

    def stop_profile(self) -> str:
        """Write the trace start_profile began; returns its path."""
        from slime_dsa.trace_recorder import ProfileError  # noqa: PLC0415

        if self._recorder is None:
            raise ProfileError("no profile is being recorded")
        return str(self._recorder.stop())

    def watch_garbage_collector(self) -> int:
        """For a process that is this rank alone, once warmed up: count Python's collections into each train call's
        trainer_gc_* metrics and freeze the start-up objects out of them (slime_dsa/gc_watch.py). Returns how many
        objects are frozen."""
        frozen = freeze_after_startup(f"trainer rank {self.rank}")  # its own collection is not a step's
        if self._gc_watch is None:
            self._gc_watch = GcWatch({}, who=f"trainer rank {self.rank}")
            self._gc_watch.install()
        return frozen

    def shutdown(self) -> None:
        if self._gc_watch is not None:
            self._gc_watch.uninstall()
        if self._gpu_meter is not None:
            self._gpu_meter.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives a backend may route elsewhere (e.g. Megatron's data-parallel group) ------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In place over the data-parallel ranks."""
        dist.all_reduce(tensor, op=op)

    def zero_gradients(self, role: Role) -> None:
        """Clear the role's gradients before a step (a backend with its own gradient buffers clears those too)."""
        role.optimizer.zero_grad(set_to_none=True)

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        """Make the gradients the global ones before clipping (a no-op where the wrapper already reduced them)."""

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip to max_norm; returns the total norm before clipping, a plain tensor."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def backward(self, held: Role, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss into the role's gradients."""
        loss.backward()

    def apply_gradients(self, held: Role) -> torch.Tensor:
        """Reduce, clip and apply the accumulated gradients; an update with a non-finite norm is skipped. Returns
        the global norm before clipping."""
        self.finish_gradients(held.trainable)
        grad_norm = self.clip_grad_norm(held.trainable, held.config.optimizer.max_grad_norm)
        step_if_finite(held.optimizer, grad_norm)
        return grad_norm

    # -- forward ----------------------------------------------------------------------------------------

    def micro_batches(self, batch: TrainBatch, role: RoleConfig) -> list[TrainBatch | None]:
        """Micro-batches by token budget (rows computed: a shared prompt counts once); every rank runs the same
        count, padded with None (collectives of sharded models must pair up)."""
        shared = (shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
                  if batch.seqlens and shares_prompts(batch, self.config, role) else None)
        groups = split_by_tokens(batch.seqlens, self.config.micro_batch_tokens, shared) if batch.seqlens else []
        micro: list[TrainBatch | None] = [batch.select(g) for g in groups]
        if self.data_parallel_size > 1:
            count = torch.tensor([len(groups)], device=self.device)
            self.all_reduce(count, op=dist.ReduceOp.MAX)
            micro += [None] * (int(count) - len(micro))
        return micro

    def forward(self, role: Role, mb: TrainBatch | None, return_entropy: bool = False, capture_dsa: bool = False,
                with_candidates: bool = False):
        """(logprobs, entropy, the micro-batch, the PackedBatch the model ran (the shared-prompt layout's when it ran
        one), the ModelOutput) of one micro-batch (None = a one-token padding pass). with_candidates: also the
        log-probs at mb.candidate_ids (out.candidate_logprobs)."""
        mb = mb if mb is not None else _padding_batch()
        dsa = role.config.dsa
        replay = mb.replay_topk if mb.replay_topk is not None else (mb.rollout_topk if dsa.index_replay else None)
        replay = None if replay is None else upload(replay, self.device)
        want_topk = replay is None and mb.rollout_topk is not None
        pack = None
        if shares_prompts(mb, self.config, role.config) and not capture_dsa:
            pack = pack_shared_prefixes(mb.input_ids, mb.seqlens, mb.prompt_lens, self.device)
        # A model given a pack runs its layout and never reads the flat one (~8 ops and an upload, not built).
        packed = pack.batch if pack is not None else PackedBatch.from_seqlens(mb.seqlens, self.device)
        candidates = upload(mb.candidate_ids, self.device) if with_candidates and mb.candidate_ids is not None else None
        logp, ent, out = role.runs.token_logprobs_with_output(
            upload(mb.input_ids, self.device), packed, temperature=self.config.temperature,
            chunk_size=self.config.logprob_chunk_size, return_entropy=return_entropy, replay_topk=replay,
            capture_dsa=capture_dsa, return_topk=want_topk, prefix_pack=pack, candidate_ids=candidates,
        )
        return logp, ent, mb, packed, out

    def value_forward(self, role: Role, mb: TrainBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A value role's (values (T,), final (S,)) of one micro-batch (None = a one-token padding pass)."""
        mb = mb if mb is not None else _padding_batch()
        packed = PackedBatch.from_seqlens(mb.seqlens, self.device)
        return role.runs.token_values(upload(mb.input_ids, self.device), packed)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch, role: str = "critic") -> tuple[torch.Tensor, torch.Tensor]:
        """A value role's V(s_t) of every token of the batch (T,) and V after each sample (N,), float32 on CPU."""
        held = self.roles[role]
        set_training(held.runs, False, held.modules)
        values, finals = [], []
        for mb in self.micro_batches(batch, held.config):
            v, final = self.value_forward(held, mb)
            if mb is not None:  # kept on the device until the last micro-batch: one copy, no sync between them
                values.append(v.float())
                finals.append(final.float())
        return (torch.cat(values).cpu(), torch.cat(finals).cpu()) if values else (torch.zeros(0), torch.zeros(0))

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, role: str = "policy") -> torch.Tensor:
        """log π of every token of the batch under the role's current weights, (T,) float32 on CPU."""
        held = self.roles[role]
        set_training(held.runs, False, held.modules)
        outs = []
        for mb in self.micro_batches(batch, held.config):
            logp, *_ = self.forward(held, mb)
            if mb is not None:  # kept on the device until the last micro-batch: one copy, no sync between them
                outs.append(logp.float())
        return torch.cat(outs).cpu() if outs else torch.zeros(0)

    # -- the step ---------------------------------------------------------------------------------------

    def warm_up(self, max_len: int) -> float | None:
        """Compile the training kernels for samples up to max_len tokens before the first step: warmup_passes on a
        GPU. Seconds taken, or None where nothing compiles (CPU, max_len 0, a backend without warms_up_kernels)."""
        if self.device.type != "cuda" or max_len <= 0 or not self.warms_up_kernels:
            return None
        start = time.perf_counter()
        try:
            self.warmup_passes(max_len)
            torch.cuda.synchronize(self.device)
            self._kernels_warmed = True
        except Exception:  # noqa: BLE001 - a failed warm-up costs its time, not the run: kernels compile in step 1
            logger.exception("trainer rank %d: kernel warm-up failed; the first steps compile instead", self.rank)
            for held in self.roles.values():
                if held.optimizer is not None:
                    self.zero_gradients(held)
        return time.perf_counter() - start

    def warmup_passes(self, max_len: int) -> None:
        """One forward and backward of each trained policy role over trainers/warmup.py's micro-batches, gradients
        cleared after; weights, optimizer state and the random generators stay as they were. Collective: every rank
        runs the same micro-batches. With trainer.compile, also the π_old pass over them: its no-grad graphs are
        their own, which later mini-batches' π_old would otherwise compile in the first step."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            for name, held in self.roles.items():
                if not (held.config.trains and held.config.kind == "policy"):
                    continue
                model_config = held.model.config
                batches = warmup_batches(max_len, model_config.index_topk, model_config.vocab_size,
                                         self.config.micro_batch_tokens, self.config.seed)
                set_training(held.runs, True, held.modules)
                self.zero_gradients(held)
                for mb in batches:
                    loss, _ = self._policy_micro_loss(held, mb, float(mb.loss_mask.sum()), len(mb.seqlens),
                                                      float(mb.num_tokens), detailed_metrics=True, measure_sync=False)
                    self.backward(held, loss)
                self.zero_gradients(held)
                if self.config.compile:
                    for mb in batches:
                        self.compute_logprobs(mb, name)

    def train_batches(self, shards: list[TrainBatch], totals: list[tuple[float, int]],
                      recompute_old_logprobs: bool = False, detailed_metrics: bool = True,
                      role: str = "policy", sent_at: float | None = None,
                      ) -> tuple[list[torch.Tensor] | None, list[dict[str, float]]]:
        """One RL step's training in one call: π_old of every shard first (when asked), then one optimiser step
        per shard. totals[i] = (loss tokens, samples) of mini-batch i over all ranks. Returns (π_old per shard or
        None, metrics per optimiser step). sent_at: the caller's wall-clock time when it made the call; the first
        step's metrics then hold trainer_dispatch_s, how long the call and its batch took to start here."""
        started_at = time.time()
        compiled_before = _compiled_frames() if self.config.compile else 0
        old = None
        # The first step's forward runs on the weights π_old is of (no update before it): its log-probs are π_old.
        reuse = recompute_old_logprobs and self.reuses_first_forward and self.roles[role].config.kind == "policy"
        if recompute_old_logprobs:
            old = [self.compute_logprobs(shard, role) if i or not reuse else None  # before any update
                   for i, shard in enumerate(shards)]
            for shard, logp in zip(shards, old):
                shard.old_logprobs = logp
        # Without a π_old pass, the first step's forward is the one that runs on the weights the engines sampled with.
        steps = [self._train_step(shard, tokens, samples, detailed_metrics, measure_sync=i == 0 and old is None,
                                  role=role, fill_old_logprobs=reuse and i == 0)
                 for i, (shard, (tokens, samples)) in enumerate(zip(shards, totals))]
        with annotate("train.read_metrics"):
            metrics = self._read_steps(steps)
        if self._gc_watch is not None and metrics:  # this process's collections since the last call
            metrics[0].update({f"trainer_{k}": v for k, v in self._gc_watch.take().items()})
        if sent_at is not None and metrics:
            metrics[0]["trainer_dispatch_s"] = max(started_at - sent_at, 0.0)
        busy = self._gpu_busy_share()
        if busy is not None and metrics:
            metrics[0]["trainer_gpu_busy_share"] = busy
        if self.config.compile and metrics:
            metrics[0]["trainer_compiles"] = compiles = _compiled_frames() - compiled_before
            if compiles and self._kernels_warmed:
                logger.warning("trainer rank %d: torch.compile compiled %d graph variants in this train call, after "
                               "the start-up warm-up (a shape or mode it did not meet; TORCH_LOGS=recompiles says "
                               "which guard failed)", self.rank, compiles)
        if reuse:
            logps = steps[0].old_logprobs
            old[0] = torch.cat(logps).cpu() if logps else torch.zeros(0)
        return old, metrics

    def _gpu_busy_share(self) -> float | None:
        """Rank 0's GPU busy share (0-1, every process on it counted) from its previous train call's end to now, by
        the driver's samples; None elsewhere, at the first call, or without NVML."""
        if self.rank != 0 or self.device.type != "cuda":
            return None
        if not self._gpu_meter_opened:
            self._gpu_meter_opened = True
            self._gpu_meter = GpuBusyMeter.open(self.device.index or 0)
            return None
        return self._gpu_meter.take() if self._gpu_meter is not None else None

    def train_step(self, batch: TrainBatch, global_loss_tokens: float, global_num_samples: int,
                   detailed_metrics: bool = True, measure_sync: bool = False, role: str = "policy") -> dict[str, float]:
        """One optimiser step of `role` over this rank's share; losses are normalised by the global counts.

        detailed_metrics off skips the metrics that cost real compute (the indexer's dense recall): for steps whose
        metrics nobody logs. Every rank must get the same value (the metric keys are reduced together).
        measure_sync adds sync_logprob_abs_diff, the mean |log π_θ − log π_roll| of this step's forward (before
        its update), its max (sync_logprob_abs_diff_max) and the bit-equal fraction (sync_logprob_exact): the
        weight-sync check when no π_old pass computes it."""
        return self._read_steps([self._train_step(batch, global_loss_tokens, global_num_samples, detailed_metrics,
                                                  measure_sync, role)])[0]

    def _train_step(self, batch: TrainBatch, global_loss_tokens: float, global_num_samples: int,
                    detailed_metrics: bool, measure_sync: bool, role: str, fill_old_logprobs: bool = False) -> StepSums:
        """train_step without reading its metrics: they stay where they were computed until _read_steps.
        fill_old_logprobs: π_old of each micro-batch is its own forward's log-probs (this step's weights are π_old's),
        kept in StepSums.old_logprobs."""
        held = self.roles[role]
        if not held.config.trains:
            raise ValueError(f"role {role!r} has no optimizer or loss: it does not train")
        dsa = held.config.dsa
        set_training(held.runs, True, held.modules)
        self.zero_gradients(held)
        sums: dict[str, Metric] = {}
        old_logprobs: list[torch.Tensor] | None = [] if fill_old_logprobs else None
        # The indexer loss is a mean over every query row of the step, on all ranks.
        step_rows = self._global_rows(batch) if held.config.kind == "policy" and dsa.indexer_loss_coef > 0 else 0.0
        for mb in self.micro_batches(batch, held.config):
            with annotate("train.forward"):
                if held.config.kind == "value":
                    values, _ = self.value_forward(held, mb)
                    loss, metrics = micro_batch_value_loss(held.config.loss, values,
                                                           mb if mb is not None else _padding_batch(),
                                                           global_loss_tokens, global_num_samples)
                else:
                    loss, metrics = self._policy_micro_loss(held, mb, global_loss_tokens, global_num_samples,
                                                            step_rows, detailed_metrics, measure_sync, old_logprobs)
            if mb is None:
                loss = loss * 0.0  # its loss_mask is 0 already; metrics keep their keys so ranks reduce alike
            if self.data_parallel_size > 1:
                # Data-parallel ranks average gradients; the loss is already a share of the global mean, so undo that.
                loss = loss * self.data_parallel_size
            with annotate("train.backward"):
                self.backward(held, loss)
            _accumulate(sums, metrics)
        if (held.config.kind == "policy" and batch.rollout_topk is not None and batch.replay_topk is None
                and not dsa.index_replay):
            for key in ("index_topk_mismatch/num", "index_topk_mismatch/den"):
                sums.setdefault(key, 0.0)  # a rank with only padding passes still reduces the same keys
        lr = held.scheduler.get_last_lr()[0]
        with annotate("train.optimizer"):
            grad_norm = self.apply_gradients(held)
        with warnings.catch_warnings():
            # A first update skipped for a non-finite norm makes torch warn that the scheduler stepped first: intended.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            held.scheduler.step()
        held.step += 1
        return StepSums(sums, grad_norm, lr, held.step - 1, old_logprobs)

    def _global_rows(self, batch: TrainBatch) -> float:
        """Query rows of the step over every data-parallel rank."""
        if self.data_parallel_size == 1:
            return float(batch.num_tokens)
        rows = torch.tensor([float(batch.num_tokens)], dtype=torch.float64, device=self.device)
        self.all_reduce(rows)
        return float(rows)

    def _policy_micro_loss(self, held: Role, mb: TrainBatch | None, step_loss_tokens: float, step_num_samples: int,
                           step_rows: float, detailed_metrics: bool, measure_sync: bool,
                           old_logprobs: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, Metric]]:
        """A policy role's loss on one micro-batch (None = padding), its indexer loss, and their metrics.
        old_logprobs: a list to append this forward's log-probs to, which are π_old (and the loss's)."""
        dsa = held.config.dsa
        logp, ent, used, packed, out = self.forward(held, mb, return_entropy=True, capture_dsa=dsa.indexer_loss_coef > 0,
                                                    with_candidates=True)
        if old_logprobs is not None and mb is not None:
            used.old_logprobs = logp.detach().float()
            old_logprobs.append(used.old_logprobs)
        loss, metrics = micro_batch_loss(held.config.loss, logp, used, ent, step_loss_tokens, step_num_samples,
                                         out.candidate_logprobs)
        indexer_loss, dsa_metrics = self._dsa_metrics(held, used, packed, out, step_rows, detailed_metrics)
        if indexer_loss is not None:
            loss = loss + indexer_loss
        metrics.update(dsa_metrics if mb is not None else {k: 0.0 for k in dsa_metrics})
        if measure_sync:  # mean and max |Δlogp| and the bit-equal fraction, over trained tokens
            sums = logprob_agreement_sums(logp.detach().float(), upload(used.rollout_logprobs, logp.device),
                                          upload(used.loss_mask, logp.device))
            metrics.update(sums if mb is not None else {k: 0.0 for k in sums})
        return loss, metrics

    def _read_steps(self, steps: list[StepSums]) -> list[dict[str, float]]:
        """The steps' metrics summed (or maxed, for "_max" keys) over ranks and read in one copy to the host; "x/num"
        and "x/den" pairs become the ratio "x"; then grad_norm, lr and skipped_updates (a non-finite norm: the step
        was skipped, on every rank alike since the norm is global)."""
        on_device: list[torch.Tensor] = []  # the values to read, each step's sum keys then its max keys
        layouts = []
        for step in steps:
            names = sorted(step.sums)
            keys = ([k for k in names if not k.endswith("_max")], [k for k in names if k.endswith("_max")])
            for op, group in zip((dist.ReduceOp.SUM, dist.ReduceOp.MAX), keys):
                if self.data_parallel_size > 1:  # every rank has the same keys: the same loss runs everywhere
                    values = torch.stack([torch.as_tensor(step.sums[k], dtype=torch.float64, device=self.device)
                                          .reshape(()) for k in group]
                                         or [torch.zeros((), dtype=torch.float64, device=self.device)])
                    self.all_reduce(values, op=op)
                    on_device.append(values[: len(group)])
                else:
                    on_device += [step.sums[k].detach().to(self.device, torch.float64).reshape(-1) for k in group
                                  if isinstance(step.sums[k], torch.Tensor)]
            on_device.append(step.grad_norm.detach().to(self.device, torch.float64).reshape(-1))
            layouts.append(keys)
        read = iter(torch.cat(on_device).tolist()) if on_device else iter(())
        out = []
        for step, (sum_keys, max_keys) in zip(steps, layouts):
            metrics: dict[str, float] = {}
            for key in sum_keys + max_keys:
                value = step.sums[key]
                read_back = self.data_parallel_size > 1 or isinstance(value, torch.Tensor)
                metrics[key] = next(read) if read_back else float(value)
            grad_norm = next(read)
            for num in [k for k in metrics if k.endswith("/num")]:
                den = metrics.pop(num[: -len("num")] + "den", 0.0)
                metrics[num[: -len("/num")]] = metrics.pop(num) / den if den else float("nan")
            if not math.isfinite(grad_norm):
                logger.warning("step %d: non-finite grad norm %s, update skipped", step.index, grad_norm)
            metrics.update({"grad_norm": grad_norm, "lr": step.lr,
                            "skipped_updates": float(not math.isfinite(grad_norm))})
            out.append(metrics)
        return out

    def _dsa_metrics(self, held: Role, mb: TrainBatch, packed: PackedBatch, out, step_rows: float,
                     recall: bool = True) -> tuple[torch.Tensor | None, dict[str, Metric]]:
        """Indexer loss (already a share of the step: sum over rows / step_rows) and DSA metrics of one micro-batch.

        "…/num" and "…/den" pairs become ratios after the cross-rank sum. recall: also the recall of each group's
        selection against its dense p_bar, which scores every causal key (O(T^2) per group, about a dense attention
        forward per member layer: as much as the whole sparse forward and backward at 1K tokens).
        """
        dsa = held.config.dsa
        metrics: dict[str, Metric] = {}
        if out.topk_indices is not None and mb.rollout_topk is not None:  # replay off: how far rollout and training disagree
            engine = upload(mb.rollout_topk, self.device)
            rows = engine[0, :, 0] != REPLAY_COMPUTE
            overlap = topk_overlap(engine[:, rows], out.topk_indices[:, rows])
            metrics["index_topk_mismatch/num"] = (1.0 - overlap).sum()
            metrics["index_topk_mismatch/den"] = float(overlap.numel())
        if out.dsa_layers is None:
            return None, metrics
        types = held.model.config.indexer_types
        res = dsa_indexer_loss(out.dsa_layers, types, packed.cu_seqlens_q, packed.cu_seqlens_k,
                               stage=dsa.indexer_stage, target=dsa.indexer_target,
                               lse_matches_stage=dsa.indexer_stage == "sparse")
        loss = res.loss_sum / max(step_rows, 1.0)
        metrics["indexer_kl"] = loss.detach()
        metrics.update({k: v / max(step_rows, 1.0) for k, v in res.metrics.items()})
        if recall:
            for key, value in group_recall(out.dsa_layers, types, packed.cu_seqlens_q, packed.cu_seqlens_k).items():
                metrics[f"indexer_{key}"] = value.sum() / max(step_rows, 1.0)
        return dsa.indexer_loss_coef * loss, metrics


    # -- the policy's weights to engines over a process group (rollout.sglang.weight_sync distributed) -------

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        """What broadcast_weights sends, in order: each tensor's name, dtype (cast for `engine_dtype`) and shape, in
        buckets of about `bucket_bytes`."""
        return bucket_specs(weight_specs(self.policy.model, engine_dtype), bucket_bytes)

    def weight_group_address(self) -> tuple[str, int]:
        """(address, free port) of this rank's node, where it can host the weight-update group."""
        return group_address()

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        """Rank 0 joins the engines' weight-update group as its rank 0; blocks until every engine rank joined."""
        from trainers.process_group import init_weight_update_group  # noqa: PLC0415

        self._weight_group = init_weight_update_group(master_address, master_port, world_size,
                                                      group_name=group_name, backend=backend)

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        """Rank 0 broadcasts the tensors of `buckets` (from weight_buckets) to its weight-update group. Collective."""
        if self.rank == 0 and self._weight_group is None:
            raise RuntimeError("broadcast_weights needs join_weight_group first")
        broadcast_weights(self.policy.model.state_dict(), buckets, self._weight_group if self.rank == 0 else None)


def _padding_batch() -> TrainBatch:
    zero = torch.zeros(1)
    return TrainBatch(input_ids=torch.zeros(1, dtype=torch.long), seqlens=[1], loss_mask=zero, rollout_logprobs=zero,
                      advantages=zero, old_logprobs=zero, returns=zero, old_values=zero)


def set_training(runs: Any, mode: bool, modules: Sequence[torch.nn.Module] | None = None) -> None:
    """runs.train(mode), skipped when its module tree is in that mode already: setting it walks every module through
    nn.Module.__setattr__ (~4 ms a train call at the small preset's ~1,000 modules on a CPU core), reading it ~1 ms.
    modules: the tree listed once (Role.modules), so that reading it is ~0.05 ms."""
    if isinstance(runs, torch.nn.Module) and all(
            module.training == mode for module in (runs.modules() if modules is None else modules)):
        return
    runs.train(mode)
