"""One FSDP2 training rank: builds the sharded model and optimiser, computes log-probs, takes RL steps.

Built in a readable order in __init__: process group → mesh → model → parallelise → optimiser → scheduler.
A group of one float32 rank is not wrapped (nothing to shard) and uses fused AdamW; so are the ranks of
data_parallel "replicate", which average their gradients with one all-reduce per optimiser step. Samples that share a prompt
are packed so the prompt runs once (models/prefix_sharing.py) unless replay or the indexer loss need the flat
layout. The same class runs as a Ray actor (trainers.fsdp.group) or directly in a test process.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torch.distributed.fsdp import register_fsdp_forward_method

from slime_dsa import ops
from slime_dsa.algorithms.indexer_loss import dsa_indexer_loss, group_recall, topk_overlap
from slime_dsa.checkpoint import load_model
from slime_dsa.models import PackedBatch
from slime_dsa.models.glm_moe_dsa import REPLAY_COMPUTE
from slime_dsa.models.prefix_sharing import pack_shared_prefixes, shared_prompt_lengths
from slime_dsa.weights.payloads import TensorSpec, bucket_specs
from trainers.base import TrainBatch, split_by_tokens
from trainers.fsdp.optim import build_optimizer, build_scheduler
from trainers.fsdp.parallelize import apply_fsdp
from trainers.loss import DSATraining
from trainers.shared_weights import SharedWeights
from trainers.weight_sender import broadcast_weights, group_address, weight_specs, write_safetensors

logger = logging.getLogger(__name__)


@dataclass
class TrainerSpec:
    """Everything a rank needs to build itself; plain data so it crosses process boundaries."""

    model_path: str
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 100
    lr_schedule: str = "constant"
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    mixed_precision: bool = False
    gradient_checkpointing: bool = False
    ops_backend: str = "auto"
    temperature: float = 1.0  # log-probs are of the tempered distribution the engine sampled from
    seed: int = 0
    freeze_indexer: bool = True
    logprob_chunk_size: int = 1024
    share_prompt_prefix: bool = True  # compute a prompt once for the consecutive samples that share it
    data_parallel: str = "fsdp"  # fsdp: shard with FSDP2; replicate: whole model per rank, one gradient all-reduce


LossFn = Callable[[torch.Tensor, TrainBatch, torch.Tensor | None, float, int], tuple[torch.Tensor, dict[str, float]]]


class FSDPWorker:
    """A training rank. Call every collective method on every rank of the group."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, spec: TrainerSpec, loss_fn: LossFn) -> None:
        self.rank, self.world_size, self.spec, self.loss_fn = rank, world_size, spec, loss_fn
        self.dsa: DSATraining = getattr(loss_fn, "dsa", None) or DSATraining()
        use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
        mesh = torch.distributed.device_mesh.init_device_mesh(self.device.type, (world_size,))
        torch.manual_seed(spec.seed)
        ops.set_backend(spec.ops_backend)

        model = load_model(spec.model_path, dtype=torch.float32, device=self.device)
        model.gradient_checkpointing = spec.gradient_checkpointing
        if spec.freeze_indexer:
            for name, p in model.named_parameters():
                if ".indexer." in name:
                    p.requires_grad_(False)
        if spec.data_parallel not in ("fsdp", "replicate"):
            raise ValueError(f"trainer.data_parallel must be fsdp or replicate, got {spec.data_parallel!r}")
        if spec.data_parallel == "replicate" and spec.mixed_precision and use_cuda:
            raise ValueError("trainer.data_parallel: replicate trains in float32; bf16 mixed precision comes with "
                             "FSDP2 (data_parallel: fsdp)")
        self.sharded = spec.data_parallel == "fsdp" and (world_size > 1 or (spec.mixed_precision and use_cuda))
        if self.sharded:
            self.model = apply_fsdp(model, mesh, spec.mixed_precision and use_cuda)
            register_fsdp_forward_method(self.model, "token_logprobs_with_output")
        else:  # float32 replicas: FSDP2 would only add parameter copies, hooks and per-layer collectives
            self.model = model
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, spec.warmup_steps, spec.total_steps, spec.lr_schedule)
        self.step = 0
        self._shared: SharedWeights | None = None  # built by the first share_weights (rollout.weight_sync cuda_ipc)
        self._weight_group = None  # rank 0's group with the engines, joined by join_weight_group (distributed sync)

    def _build_optimizer(self) -> torch.optim.AdamW:
        """AdamW; with dsa.indexer_learning_rate the indexers get their own param groups at that rate."""
        spec, lr_idx = self.spec, self.dsa.indexer_learning_rate
        # Fused kernels for plain tensors (one rank): one pass over all parameters instead of ~10 ops each.
        fused = not self.sharded
        if lr_idx is None:
            return build_optimizer(self.model, spec.learning_rate, spec.weight_decay, tuple(spec.adam_betas), fused=fused)
        groups = []
        for is_indexer, lr in ((False, spec.learning_rate), (True, lr_idx)):
            params = [p for n, p in self.model.named_parameters() if p.requires_grad and (".indexer." in n) == is_indexer]
            groups += [{"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay, "lr": lr},
                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=spec.learning_rate,
                                 betas=tuple(spec.adam_betas), eps=1e-8, fused=fused or None)

    # -- forward helpers ---------------------------------------------------------------------

    def _shares_prompts(self, batch: TrainBatch) -> bool:
        return shares_prompts(batch, self.spec, self.dsa)

    def _micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        """Micro-batches by token budget (rows computed: a shared prompt counts once); every rank runs the same
        count (FSDP collectives must pair up)."""
        shared = (shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
                  if batch.seqlens and self._shares_prompts(batch) else None)
        groups = split_by_tokens(batch.seqlens, self.spec.micro_batch_tokens, shared) if batch.seqlens else []
        count = torch.tensor([len(groups)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        micro = [batch.select(g) for g in groups]
        while len(micro) < int(count):
            micro.append(None)  # a padding pass keeps collectives aligned
        return micro

    def _replay_rows(self, mb: TrainBatch) -> torch.Tensor | None:
        """The selection to replay: batch.replay_topk, or the engines' top-k when dsa.index_replay is on."""
        replay = mb.replay_topk if mb.replay_topk is not None else (mb.rollout_topk if self.dsa.index_replay else None)
        return None if replay is None else replay.to(self.device)

    def _logprobs(self, mb: TrainBatch | None, return_entropy: bool = False, capture_dsa: bool = False):
        """(logprobs, entropy, the micro-batch, its PackedBatch, the ModelOutput) of one micro-batch."""
        if mb is None:  # padding pass: one token, contributes zero loss
            mb = _padding_batch()
        ids = mb.input_ids.to(self.device)
        packed = PackedBatch.from_seqlens(mb.seqlens, self.device)
        replay = self._replay_rows(mb)
        want_topk = replay is None and mb.rollout_topk is not None
        pack = None
        if self._shares_prompts(mb) and replay is None and not want_topk and not capture_dsa:
            pack = pack_shared_prefixes(mb.input_ids, mb.seqlens, mb.prompt_lens, self.device)
        logp, ent, out = self.model.token_logprobs_with_output(
            ids, packed, temperature=self.spec.temperature, chunk_size=self.spec.logprob_chunk_size,
            return_entropy=return_entropy, replay_topk=replay, capture_dsa=capture_dsa, return_topk=want_topk,
            prefix_pack=pack,
        )
        return logp, ent, mb, packed, out

    def _dsa_metrics(self, mb: TrainBatch, packed: PackedBatch, out, step_rows: float,
                     recall: bool = True) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Indexer loss (already a share of the step: sum over rows / step_rows) and DSA metrics of one micro-batch.

        "…/num" and "…/den" pairs become ratios after the cross-rank sum (see train_step). recall: also the recall
        of each group's selection against its dense p_bar, which scores every causal key (O(T^2) per group, about a
        dense attention forward per member layer: as much as the whole sparse forward and backward at 1K tokens).
        """
        metrics: dict[str, float] = {}
        if out.topk_indices is not None and mb.rollout_topk is not None:  # replay off: how far rollout and training disagree
            engine = mb.rollout_topk.to(self.device)
            rows = engine[0, :, 0] != REPLAY_COMPUTE
            overlap = topk_overlap(engine[:, rows], out.topk_indices[:, rows])
            metrics["index_topk_mismatch/num"] = float((1.0 - overlap).sum())
            metrics["index_topk_mismatch/den"] = float(overlap.numel())
        if out.dsa_layers is None:
            return None, metrics
        types = self.model.config.indexer_types
        res = dsa_indexer_loss(out.dsa_layers, types, packed.cu_seqlens_q, packed.cu_seqlens_k,
                               stage=self.dsa.indexer_stage, target=self.dsa.indexer_target,
                               lse_matches_stage=self.dsa.indexer_stage == "sparse")
        loss = res.loss_sum / max(step_rows, 1.0)
        metrics["indexer_kl"] = float(loss.detach())
        metrics.update({k: v / max(step_rows, 1.0) for k, v in res.metrics.items()})
        if recall:
            for key, value in group_recall(out.dsa_layers, types, packed.cu_seqlens_q, packed.cu_seqlens_k).items():
                metrics[f"indexer_{key}"] = float(value.sum()) / max(step_rows, 1.0)
        return self.dsa.indexer_loss_coef * loss, metrics

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π of every token of the batch under the current weights, (T,) float32 on CPU."""
        self.model.eval()
        outs = []
        for mb in self._micro_batches(batch):
            logp, *_ = self._logprobs(mb)
            if mb is not None:
                outs.append(logp.float().cpu())
        return torch.cat(outs) if outs else torch.zeros(0)

    # -- the step ----------------------------------------------------------------------------

    def train_batches(self, shards: list[TrainBatch], totals: list[tuple[float, int]],
                      recompute_old_logprobs: bool = False,
                      detailed_metrics: bool = True) -> tuple[list[torch.Tensor] | None, list[dict[str, float]]]:
        """One RL step's training in one call: π_old of every shard first (when asked), then one optimiser step
        per shard. totals[i] = (loss tokens, samples) of mini-batch i over all ranks. Returns (π_old per shard or
        None, metrics per optimiser step)."""
        old = None
        if recompute_old_logprobs:
            old = [self.compute_logprobs(shard) for shard in shards]  # all before the first update: π_old is π_θ now
            for shard, logp in zip(shards, old):
                shard.old_logprobs = logp
        # Without a π_old pass, the first step's forward is the one that runs on the weights the engines sampled with.
        metrics = [self.train_step(shard, tokens, samples, detailed_metrics, measure_sync=i == 0 and old is None)
                   for i, (shard, (tokens, samples)) in enumerate(zip(shards, totals))]
        return old, metrics

    def train_step(self, batch: TrainBatch, global_loss_tokens: float, global_num_samples: int,
                   detailed_metrics: bool = True, measure_sync: bool = False) -> dict[str, float]:
        """One optimiser step over this rank's share; losses are normalised by the global counts.

        detailed_metrics off skips the metrics that cost real compute (the indexer's dense recall): for steps whose
        metrics nobody logs. Every rank must get the same value (the metric keys are reduced together).
        measure_sync adds sync_logprob_abs_diff, the mean |log π_θ − log π_roll| of this step's forward (before
        its update): the weight-sync check when no π_old pass computes it."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        capture = self.dsa.indexer_loss_coef > 0
        step_rows = torch.tensor([float(batch.num_tokens)], dtype=torch.float64, device=self.device)
        dist.all_reduce(step_rows)  # the indexer loss is a mean over every query row of the step, on all ranks
        for mb in self._micro_batches(batch):
            logp, ent, used, packed, out = self._logprobs(mb, return_entropy=True, capture_dsa=capture)
            loss, metrics = self.loss_fn(logp, used, ent, global_loss_tokens, global_num_samples)
            indexer_loss, dsa_metrics = self._dsa_metrics(used, packed, out, float(step_rows), recall=detailed_metrics)
            if indexer_loss is not None:
                loss = loss + indexer_loss
            metrics = {**metrics, **(dsa_metrics if mb is not None else {k: 0.0 for k in dsa_metrics})}
            if measure_sync:
                gap = (logp.detach().float() - used.rollout_logprobs.to(logp.device)).abs() * used.loss_mask.to(logp.device)
                metrics["sync_logprob_abs_diff/num"] = float(gap.sum()) if mb is not None else 0.0
                metrics["sync_logprob_abs_diff/den"] = float(used.loss_mask.sum()) if mb is not None else 0.0
            if mb is None:
                loss = loss * 0.0  # its loss_mask is 0 already; metrics keep their keys so ranks reduce alike
            # Ranks average gradients; the loss is already a share of the global mean, so undo that.
            (loss * self.world_size).backward()
            for k, v in metrics.items():
                # "_max" metrics reduce by max; the rest are already weighted shares of the step and add up.
                sums[k] = max(sums.get(k, float("-inf")), float(v)) if k.endswith("_max") else sums.get(k, 0.0) + float(v)
        if batch.rollout_topk is not None and batch.replay_topk is None and not self.dsa.index_replay:
            for key in ("index_topk_mismatch/num", "index_topk_mismatch/den"):
                sums.setdefault(key, 0.0)  # a rank with only padding passes still reduces the same keys
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self.sharded and self.world_size > 1:
            average_gradients(trainable, self.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, self.spec.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("step %d: non-finite grad norm %s, update skipped", self.step, grad_norm)
        self.scheduler.step()
        self.step += 1
        out = {}
        for op, keys in ((dist.ReduceOp.SUM, [k for k in sorted(sums) if not k.endswith("_max")]),
                         (dist.ReduceOp.MAX, [k for k in sorted(sums) if k.endswith("_max")])):
            values = torch.tensor([sums[k] for k in keys] or [0.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(values, op=op)  # every rank has the same keys: the same loss runs everywhere
            out.update({k: float(v) for k, v in zip(keys, values.tolist())})
        for num in [k for k in out if k.endswith("/num")]:
            den = out.pop(num[: -len("num")] + "den", 0.0)
            out[num[: -len("/num")]] = out.pop(num) / den if den else float("nan")
        out.update({"grad_norm": float(grad_norm), "lr": lr})
        return out

    # -- weights and checkpoints ---------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full (unsharded) float32 state dict on CPU on rank 0; None elsewhere. Collective."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def save_weights(self, path: str) -> None:
        """Write the full state dict to the safetensors file `path` (rank 0), atomically. Collective."""
        # One unsharded rank: its own tensors, written at once (no gathered copy needed).
        state = self.full_state_dict() if self.sharded else {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}
        if self.rank == 0:
            write_safetensors(state, path)

    def share_weights(self, engine_dtype: str) -> dict | None:
        """The weights, cast to the engine's dtypes, in one buffer on rank 0's GPU that engines on that GPU open by
        CUDA IPC; rank 0 returns its JSON table (slime_dsa.weights.cuda_ipc), the others None. Collective."""
        if self._shared is None:
            if self.device.type != "cuda":
                raise RuntimeError("share_weights (rollout.weight_sync cuda_ipc) needs trainer ranks on CUDA devices")
            self._shared = SharedWeights(self.model, engine_dtype, sender=self.rank == 0)
        return self._shared.fill(self.model)

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        """What broadcast_weights sends, in order: each tensor's name, dtype (cast for `engine_dtype`) and shape, in
        buckets of about `bucket_bytes`."""
        return bucket_specs(weight_specs(self.model, engine_dtype), bucket_bytes)

    def weight_group_address(self) -> tuple[str, int]:
        """(address, free port) of this rank's node, where it can host the weight-update group."""
        return group_address()

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        """Rank 0 joins the engines' weight-update group as its rank 0; blocks until every engine rank joined."""
        from slime_dsa.weights.process_group import init_weight_update_group  # noqa: PLC0415

        self._weight_group = init_weight_update_group(master_address, master_port, world_size,
                                                      group_name=group_name, backend=backend)

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        """Rank 0 broadcasts the tensors of `buckets` (from weight_buckets) to its weight-update group. Collective."""
        if self.rank == 0 and self._weight_group is None:
            raise RuntimeError("broadcast_weights needs join_weight_group first")
        broadcast_weights(self.model.state_dict(), buckets, self._weight_group if self.rank == 0 else None)

    def cuda_device(self) -> str | None:
        """The UUID of this rank's GPU (None on CPU): engines with the same UUID share its memory."""
        from slime_dsa.weights.cuda_ipc import device_uuid  # noqa: PLC0415

        return device_uuid(self.device) if self.device.type == "cuda" else None

    def node_id(self) -> str | None:
        """The Ray node this rank runs on (None outside Ray)."""
        import ray  # noqa: PLC0415

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def training_state(self) -> dict:
        """Scheduler, step and RNG: what exact resumption needs beside model and optimiser."""
        return {
            "step": self.step, "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        }

    def save_checkpoint(self, directory: str) -> None:
        """Sharded model + optimiser with torch.distributed.checkpoint, plus per-rank training state. Collective."""
        from trainers.fsdp.checkpointing import save_rank_checkpoint  # noqa: PLC0415

        save_rank_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from trainers.fsdp.checkpointing import load_rank_checkpoint  # noqa: PLC0415

        load_rank_checkpoint(self, directory)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def shares_prompts(batch: TrainBatch, spec: TrainerSpec, dsa: DSATraining) -> bool:
    """Whether this batch trains with shared-prompt packing. Top-k replay, the top-k mismatch metric and the
    indexer loss work on the flat layout."""
    return (spec.share_prompt_prefix and batch.prompt_lens is not None and batch.replay_topk is None
            and batch.rollout_topk is None and dsa.indexer_loss_coef == 0)


def average_gradients(params: list[torch.Tensor], world_size: int) -> None:
    """Average the gradients of replicated parameters over ranks in one flat all-reduce (DDP's job, done once per
    optimiser step because the trainer enters the model through token_logprobs, which DDP does not hook)."""
    for p in params:
        if p.grad is None:  # an expert no token of this rank reached: every rank must send the same layout
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= world_size
    for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def _padding_batch() -> TrainBatch:
    zero = torch.zeros(1)
    return TrainBatch(input_ids=torch.zeros(1, dtype=torch.long), seqlens=[1], loss_mask=zero, rollout_logprobs=zero,
                      advantages=zero, old_logprobs=zero)
