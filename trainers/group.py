"""A group of training ranks as Ray actors, for any backend: fans every call out to all ranks and gathers the
answers. The batch is split by rank here (whole groups per rank where their prompt is computed once)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import ray
import torch

from slime_dsa.models.prefix_sharing import shared_prompt_lengths
from slime_dsa.trace_recorder import ACTIVITIES
from slime_dsa.weights.payloads import TensorSpec
from trainers.base import CALL_METRIC_PREFIXES, RankConfig, TrainBatch, balance_across_ranks
from trainers.rank import TrainerRank, combine_steps, shares_prompts
from trainers.rendezvous import host_store

logger = logging.getLogger(__name__)


class RayTrainerGroup:
    """N ranks of `rank_class` on one Ray cluster; the orchestrator's handle to training (trainers.base.TrainerGroup)."""

    rank_class: type[TrainerRank]  # set by each backend's subclass

    def __init__(self, config: RankConfig, num_workers: int, num_cpus_per_worker: float = 1,
                 num_gpus_per_worker: float = 0) -> None:
        actor_cls = ray.remote(self.rank_class)
        # The ranks meet at a store this process hosts: its address is known before Ray places rank 0 on some node
        address = ray.util.get_node_ip_address()
        self._store, port = host_store(address)
        self.config = config
        self.workers = [
            actor_cls.options(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)
            .remote(rank, num_workers, address, port, config, store_hosted=True)
            for rank in range(num_workers)
        ]
        ray.get([w.__ray_ready__.remote() for w in self.workers])
        # The data-parallel rank of each rank: the batch is split over data-parallel ranks, and tensor-parallel peers
        # (same data-parallel rank) get the same shard; each shard's results are read from its first rank.
        layouts = ray.get([w.data_parallel_layout.remote() for w in self.workers])
        self.dp_ranks = [dp_rank for dp_rank, _ in layouts]
        self.dp_size = layouts[0][1]
        self._readers = [self.dp_ranks.index(d) for d in range(self.dp_size)]
        seconds = ray.get([w.warm_up.remote(config.warmup_max_len) for w in self.workers])[0]
        if seconds is not None:
            logger.info("trainer kernels compiled for samples up to %d tokens in %.1f s (before the first step)",
                        config.warmup_max_len, seconds)
        ray.get([w.watch_garbage_collector.remote() for w in self.workers])

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _per_rank(self, shards: list):
        """Each rank's item of a per-data-parallel-rank list."""
        return [shards[d] for d in self.dp_ranks]

    def _per_shard(self, results: list) -> list:
        """Per-rank results -> one per data-parallel rank (its first rank's)."""
        return [results[r] for r in self._readers]

    def _shards(self, batch: TrainBatch, role: str) -> tuple[list[list[int]], list[TrainBatch]]:
        """(sample ids per data-parallel rank, its sub-batch): a group's samples stay on one data-parallel rank when
        its prompt is computed once (shared-prompt packing), so that no two ranks compute the same prompt."""
        if self.dp_size == 1:
            return [list(range(len(batch.seqlens)))], [batch]
        shared = (shared_prompt_lengths(batch.input_ids, batch.seqlens, batch.prompt_lens)
                  if batch.seqlens and shares_prompts(batch, self.config, self.config.roles[role]) else None)
        assignment = balance_across_ranks(batch.seqlens, self.dp_size, shared)
        return assignment, [batch.select(ids) for ids in assignment]

    def compute_logprobs(self, batch: TrainBatch, role: str = "policy") -> torch.Tensor:
        """(T,) log-probs of the whole batch under the role's weights, in the batch's token order."""
        assignment, shards = self._shards(batch, role)
        results = self._per_shard(ray.get([w.compute_logprobs.remote(s, role)
                                           for w, s in zip(self.workers, self._per_rank(shards))]))
        out = torch.zeros(batch.num_tokens)
        _scatter_rows(out, batch.seqlens, list(range(len(batch.seqlens))), assignment, results)
        return out

    def compute_values(self, batch: TrainBatch, role: str = "critic") -> tuple[torch.Tensor, torch.Tensor]:
        """A value role's (values (T,) in the batch's token order, final (N,) in its sample order)."""
        assignment, shards = self._shards(batch, role)
        results = self._per_shard(ray.get([w.compute_values.remote(s, role)
                                           for w, s in zip(self.workers, self._per_rank(shards))]))
        values, final = torch.zeros(batch.num_tokens), torch.zeros(len(batch.seqlens))
        samples = list(range(len(batch.seqlens)))
        _scatter_rows(values, batch.seqlens, samples, assignment, [v for v, _ in results])
        _scatter_rows(final, [1] * len(samples), samples, assignment, [f for _, f in results])
        return values, final

    def train(self, batch: TrainBatch, num_mini_batches: int = 1, recompute_old_logprobs: bool = False,
              detailed_metrics: bool = True, role: str = "policy",
              on_sent: Callable[[], None] | None = None) -> tuple[torch.Tensor | None, dict[str, float]]:
        """An RL step's training in one call per rank: π_old (when asked, before any update) and num_mini_batches
        optimiser steps, each on a contiguous slice of the samples (groups stay together as far as the split
        allows). Returns (π_old (T,) in batch order or None, metrics averaged over the steps, lr the last one's,
        skipped_updates summed, trainer_dispatch_s: from this call to rank 0 starting it, on the wall clock;
        trainer_compiles with trainer.compile: graph variants rank 0 compiled in the call).
        detailed_metrics off skips the costly metrics (the indexer's dense recall) on steps that are not logged.
        on_sent: called once the call is sent to every rank (its batch with it), before the wait for the answers."""
        called_at = time.time()
        n = len(batch.seqlens)
        parts = [list(range(i * n // num_mini_batches, (i + 1) * n // num_mini_batches)) for i in range(num_mini_batches)]
        parts = [p for p in parts if p]
        per_shard: list[list[TrainBatch]] = [[] for _ in range(self.dp_size)]
        layouts, totals = [], []
        for part in parts:
            mb = batch.select(part) if len(parts) > 1 else batch
            assignment, shards = self._shards(mb, role)
            for d, shard in enumerate(shards):
                per_shard[d].append(shard)
            layouts.append((part, assignment))
            totals.append((float(mb.loss_mask.sum()), len(mb.seqlens)))
        calls = [w.train_batches.remote(shards, totals, recompute_old_logprobs, detailed_metrics, role, called_at)
                 for w, shards in zip(self.workers, self._per_rank(per_shard))]
        if on_sent is not None:
            on_sent()
        results = self._per_shard(ray.get(calls))
        steps = results[0][1]
        # The weight-sync check is the first step's alone (its weights are the engines'), and rank 0's garbage
        # collections, compiles and the call's dispatch are the call's, not a step's.
        once = {k: steps[0].pop(k) for k in list(steps[0])
                if k.startswith(("sync_logprob_", *CALL_METRIC_PREFIXES))}
        metrics = combine_steps(steps)
        metrics.update(once)
        if not recompute_old_logprobs:
            return None, metrics
        old = torch.zeros(batch.num_tokens)
        for m, (part, assignment) in enumerate(layouts):
            _scatter_rows(old, batch.seqlens, part, assignment, [results[d][0][m] for d in range(self.dp_size)])
        return old, metrics

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor]:
        return ray.get([w.full_state_dict.remote(role) for w in self.workers])[0]

    def save_weights(self, path: str, role: str = "policy") -> None:
        """Rank 0 writes the role's full state dict to the safetensors file `path` (atomically)."""
        ray.get([w.save_weights.remote(path, role) for w in self.workers])

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
        """Rank 0 broadcasts the weights to the engines, in the order of `buckets` (see TrainerRank.broadcast_weights)."""
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

    def release_memory(self, min_free_share: float | None = None) -> None:
        ray.get([w.release_memory.remote(min_free_share) for w in self.workers])

    def release_memory_and_share_weights(self, engine_dtype: str, min_free_share: float | None = None) -> dict:
        """share_weights, then release_memory, in one Ray call per rank (the colocated step between training and
        the push); rank 0's cuda_ipc table. Releasing last also returns what filling the buffer cached."""
        return ray.get([w.__ray_call__.remote(share_then_release, engine_dtype, min_free_share)
                        for w in self.workers])[0]

    def resume_memory(self) -> None:
        ray.get([w.resume_memory.remote() for w in self.workers])

    def start_profile(self, directory: str, activities: Sequence[str] = ACTIVITIES) -> None:
        ray.get([w.start_profile.remote(directory, activities) for w in self.workers])

    def stop_profile(self) -> list[str]:
        return ray.get([w.stop_profile.remote() for w in self.workers])

    def shutdown(self) -> None:
        ray.get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            ray.kill(w)


def share_then_release(rank: TrainerRank, engine_dtype: str, min_free_share: float | None = None) -> dict | None:
    """On a rank: its share_weights table (rank 0's; the others None), then its cached memory released."""
    table = rank.share_weights(engine_dtype)
    rank.release_memory(min_free_share)
    return table


def _scatter_rows(out: torch.Tensor, seqlens: list[int], part: list[int], assignment: list[list[int]],
                  per_rank: list[torch.Tensor]) -> None:
    """Write each rank's rows back in batch order: sample i of a rank's shard is sample part[i] of the batch."""
    starts = [0]
    for length in seqlens:
        starts.append(starts[-1] + length)
    for ids, logp in zip(assignment, per_rank):
        offset = 0
        for i in ids:
            n = seqlens[part[i]]
            out[starts[part[i]] : starts[part[i]] + n] = logp[offset : offset + n]
            offset += n
