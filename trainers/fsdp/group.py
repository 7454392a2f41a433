"""A group of FSDP2 ranks as Ray actors; fans every call out to all ranks and gathers the answers."""

from __future__ import annotations

import socket

import ray
import torch

from slime_dsa.models.prefix_sharing import shared_prompt_lengths
from slime_dsa.weights.payloads import TensorSpec
from trainers.base import TrainBatch, balance_across_ranks
from trainers.fsdp.worker import FSDPWorker, LossFn, TrainerSpec, shares_prompts
from trainers.loss import DSATraining


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerGroup:
    """N FSDP ranks on one Ray cluster; the orchestrator's handle to training."""

    def __init__(self, spec: TrainerSpec, loss_fn: LossFn, num_workers: int, num_cpus_per_worker: float = 1,
                 num_gpus_per_worker: float = 0, placement_group=None, bundle_offset: int = 0) -> None:
        actor_cls = ray.remote(FSDPWorker)
        port = free_port()
        self.spec = spec
        self.dsa: DSATraining = getattr(loss_fn, "dsa", None) or DSATraining()
        self.workers = []
        for rank in range(num_workers):
            options = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
            if placement_group is not None:
                from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_offset + rank
                )
            self.workers.append(actor_cls.options(**options).remote(rank, num_workers, "127.0.0.1", port, spec, loss_fn))
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _shards(self, batch: TrainBatch) -> tuple[list[list[int]], list[TrainBatch]]:
        """(sample ids per rank, the rank's sub-batch): a group's samples stay on one rank when its prompt is
        computed once (shared-prompt packing), so that no two ranks compute the same prompt."""
        shared = (shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
                  if batch.seqlens and shares_prompts(batch, self.spec, self.dsa) else None)
        assignment = balance_across_ranks(batch.seqlens, self.world_size, shared)
        return assignment, [batch.select(ids) for ids in assignment]

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """(T,) log-probs of the whole batch, in the batch's token order."""
        assignment, shards = self._shards(batch)
        results = ray.get([w.compute_logprobs.remote(s) for w, s in zip(self.workers, shards)])
        starts = [0]
        for n in batch.seqlens:
            starts.append(starts[-1] + n)
        out = torch.zeros(batch.num_tokens)
        for ids, logp in zip(assignment, results):
            offset = 0
            for i in ids:
                n = batch.seqlens[i]
                out[starts[i] : starts[i] + n] = logp[offset : offset + n]
                offset += n
        return out

    def train_step(self, batch: TrainBatch, detailed_metrics: bool = True) -> dict[str, float]:
        """One optimiser step over the batch; metrics come back summed over ranks where they are sums.

        detailed_metrics off skips the costly metrics (the indexer's dense recall) on steps that are not logged."""
        _, shards = self._shards(batch)
        loss_tokens = float(batch.loss_mask.sum())
        results = ray.get([w.train_step.remote(s, loss_tokens, len(batch.seqlens), detailed_metrics)
                           for w, s in zip(self.workers, shards)])
        return results[0]

    def train(self, batch: TrainBatch, num_mini_batches: int = 1, recompute_old_logprobs: bool = False,
              detailed_metrics: bool = True) -> tuple[torch.Tensor | None, dict[str, float]]:
        """An RL step's training in one call per rank: π_old (when asked, before any update) and num_mini_batches
        optimiser steps, each on a contiguous slice of the samples (groups stay together as far as the split
        allows). Returns (π_old (T,) in batch order or None, metrics averaged over the steps, lr the last one's).
        detailed_metrics off skips the costly metrics (the indexer's dense recall) on steps that are not logged."""
        n = len(batch.seqlens)
        parts = [list(range(i * n // num_mini_batches, (i + 1) * n // num_mini_batches)) for i in range(num_mini_batches)]
        parts = [p for p in parts if p]
        per_rank: list[list[TrainBatch]] = [[] for _ in self.workers]
        layouts, totals = [], []
        for part in parts:
            mb = batch.select(part) if len(parts) > 1 else batch
            assignment, shards = self._shards(mb)
            for rank, shard in enumerate(shards):
                per_rank[rank].append(shard)
            layouts.append((part, assignment))
            totals.append((float(mb.loss_mask.sum()), len(mb.seqlens)))
        results = ray.get([w.train_batches.remote(shards, totals, recompute_old_logprobs, detailed_metrics)
                           for w, shards in zip(self.workers, per_rank)])
        steps = results[0][1]
        sync_gap = steps[0].pop("sync_logprob_abs_diff", None)  # the first step's alone: its weights are the engines'
        metrics = {k: sum(m[k] for m in steps) / len(steps) for k in steps[0]}
        metrics["lr"] = steps[-1]["lr"]
        if sync_gap is not None:
            metrics["sync_logprob_abs_diff"] = sync_gap
        if not recompute_old_logprobs:
            return None, metrics
        starts = [0]
        for length in batch.seqlens:
            starts.append(starts[-1] + length)
        old = torch.zeros(batch.num_tokens)
        for m, (part, assignment) in enumerate(layouts):
            for rank, ids in enumerate(assignment):
                logp, offset = results[rank][0][m], 0
                for i in ids:  # sample i of the mini-batch is sample part[i] of the batch
                    length = batch.seqlens[part[i]]
                    old[starts[part[i]] : starts[part[i]] + length] = logp[offset : offset + length]
                    offset += length
        return old, metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def save_weights(self, path: str) -> None:
        """Rank 0 writes the full state dict to the safetensors file `path` (atomically)."""
        ray.get([w.save_weights.remote(path) for w in self.workers])

    def share_weights(self, engine_dtype: str) -> dict:
        """Rank 0's cuda_ipc table of the current weights in one GPU buffer (see FSDPWorker.share_weights)."""
        return ray.get([w.share_weights.remote(engine_dtype) for w in self.workers])[0]

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        """Rank 0's names, dtypes and shapes in the order broadcast_weights sends them, in buckets."""
        return ray.get(self.workers[0].weight_buckets.remote(engine_dtype, bucket_bytes))

    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 can host the weight-update group: its node's address and a free port."""
        return ray.get(self.workers[0].weight_group_address.remote())

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str) -> None:
        """Rank 0 joins the engines' weight-update group (blocks until every engine rank joined)."""
        ray.get(self.workers[0].join_weight_group.remote(master_address, master_port, world_size, group_name, backend))

    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        """Rank 0 broadcasts the weights to the engines, in the order of `buckets` (see FSDPWorker.broadcast_weights)."""
        ray.get([w.broadcast_weights.remote(buckets) for w in self.workers])

    def cuda_device(self) -> str | None:
        """The GPU UUID of rank 0, whose memory cuda_ipc engines read."""
        return ray.get(self.workers[0].cuda_device.remote())

    def node_id(self) -> str | None:
        """The Ray node of rank 0, which writes weight files."""
        return ray.get(self.workers[0].node_id.remote())

    def save_checkpoint(self, directory: str) -> None:
        ray.get([w.save_checkpoint.remote(directory) for w in self.workers])

    def load_checkpoint(self, directory: str) -> None:
        ray.get([w.load_checkpoint.remote(directory) for w in self.workers])

    def shutdown(self) -> None:
        ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)
