"""DeepSpeed ZeRO training ranks: the backend supplies model wrapping, optimizer, collectives and checkpoint format;
the step itself is trainers/rank.py's, whose two engine hooks route here: `backward` to engine.backward and
`apply_gradients` to engine.step (reduction, clipping from trainer.max_grad_norm, the update; DeepSpeed skips an
update whose gradient norm is not finite).

Built in a readable order in __init__: process group → each role's engine (engine.py) → scheduler. The same class
runs as a Ray actor (trainers.deepspeed.group) or directly in a test process.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from slime_dsa import ops
from slime_dsa.checkpoint import load_model, load_value_model
from slime_dsa.weights.payloads import TensorSpec, bucket_specs
from trainers.base import RankConfig, RoleConfig
from trainers.deepspeed.config import DeepSpeedOptions, deepspeed_config
from trainers.deepspeed.engine import BuiltEngine, EngineModel, build_engine, skip_shared_memory_comm_op
from trainers.deepspeed.gather import weight_specs, whole_tensors
from trainers.optim import build_scheduler
from trainers.rank import Role, TrainerRank
from trainers.rendezvous import join_default_group
from trainers.shared_weights import SharedWeights
from trainers.weight_sender import write_safetensors

logger = logging.getLogger(__name__)


class DeepSpeedWorker(TrainerRank):
    """A DeepSpeed ZeRO rank. Call every collective method on every rank of the group."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config: RankConfig,
                 store_hosted: bool = False) -> None:
        super().__init__(rank, world_size, config)
        if config.compile:  # the recipe refuses it; a RankConfig built by hand must not be ignored
            raise ValueError("trainer.compile is built for the fsdp backend, not deepspeed")
        use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        # DeepSpeed reads its rank's device from LOCAL_RANK.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(self.device.index or 0))
        join_default_group(rank, world_size, master_addr, master_port, self.device, store_hosted)
        if not use_cuda:
            skip_shared_memory_comm_op()
        torch.manual_seed(config.seed)
        ops.set_backend(config.ops_backend)
        self.options = DeepSpeedOptions(**config.backend_options)
        self.mixed_precision = config.mixed_precision and use_cuda  # bf16 on GPUs, as FSDP2's
        self.engines: dict[str, BuiltEngine] = {}
        self.roles = {name: self._build_role(name, role) for name, role in config.roles.items()}
        self._shared: SharedWeights | None = None  # built by the first share_weights (rollout.weight_sync cuda_ipc)

    def _build_role(self, name: str, config: RoleConfig) -> Role:
        """The role's engine over its float32 weights (a value role: a value model, or a policy's backbone under a
        fresh head seeded by the run's seed), and the learning-rate schedule over its optimizer."""
        if not config.trains:
            raise ValueError(f"role {name!r} is only evaluated; the deepspeed backend holds trained roles only")

        def load(device: torch.device) -> torch.nn.Module:
            if config.kind == "value":
                model = load_value_model(config.model_path, dtype=torch.float32, device=device, seed=self.config.seed)
            else:
                model = load_model(config.model_path, dtype=torch.float32, device=device)
            model.gradient_checkpointing = self.config.gradient_checkpointing
            return model

        ds_config = deepspeed_config(self.options, config.optimizer.max_grad_norm, self.mixed_precision,
                                     pin_memory=self.device.type == "cuda")
        built = build_engine(load, config, ds_config, self.options, self.device)
        self.engines[name] = built
        opt = config.optimizer
        scheduler = build_scheduler(built.basic_optimizer, opt.warmup_steps, opt.total_steps, opt.lr_schedule)
        return Role(config, EngineModel(built.engine), built.engine.optimizer, scheduler)

    def _engine(self, held: Role):
        return held.model.engine

    # -- the shared step's engine hooks -------------------------------------------------------------

    def backward(self, held: Role, loss: torch.Tensor) -> None:
        """engine.backward: ZeRO-2/3 reduce each micro-batch's gradients into their partitions as they come."""
        self._engine(held).backward(loss)

    def apply_gradients(self, held: Role) -> torch.Tensor:
        """engine.step: reduce, clip to trainer.max_grad_norm and update (skipped on a non-finite norm)."""
        engine = self._engine(held)
        engine.step()
        norm = engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    # -- weights and checkpoints ---------------------------------------------------------------------

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor] | None:
        """The role's whole state dict on CPU on rank 0, as the model computes with it; None elsewhere. Collective."""
        state = {}
        for name, tensor in whole_tensors(self.roles[role].model.module):
            if self.rank == 0:
                state[name] = tensor.to("cpu", copy=True)
        return state if self.rank == 0 else None

    def save_weights(self, path: str, role: str = "policy") -> None:
        """Write the role's whole state dict to the safetensors file `path` (rank 0), atomically. Collective."""
        state = self.full_state_dict(role)
        if self.rank == 0:
            write_safetensors(state, path)

    def weight_buckets(self, engine_dtype: str | None, bucket_bytes: int) -> list[list[TensorSpec]]:
        return bucket_specs(weight_specs(self.policy.model.module, engine_dtype), bucket_bytes)

    @torch.no_grad()
    def broadcast_weights(self, buckets: list[list[TensorSpec]]) -> None:
        """Rank 0 broadcasts each bucket's tensors as ZeRO-3 gathers them (one bucket at a time). Collective."""
        if self.rank == 0 and self._weight_group is None:
            raise RuntimeError("broadcast_weights needs join_weight_group first")
        model = self.policy.model.module
        for bucket in buckets:
            dtypes = {spec.name: getattr(torch, spec.dtype) for spec in bucket}
            for name, tensor in whole_tensors(model, list(dtypes), bucket_bytes=2**62):
                if self.rank == 0:
                    dist.broadcast(tensor.to(dtypes[name]).contiguous(), src=0, group=self._weight_group)

    def share_weights(self, engine_dtype: str) -> dict | None:
        """The weights, cast to the engine's dtypes, in one buffer on rank 0's GPU that engines on that GPU open by
        CUDA IPC, filled a gathered bucket at a time; rank 0 returns its JSON table, the others None. Collective."""
        model = self.policy.model.module
        if self._shared is None:
            if self.device.type != "cuda":
                raise RuntimeError("share_weights (rollout.weight_sync cuda_ipc) needs trainer ranks on CUDA devices")
            self._shared = SharedWeights(model, engine_dtype, sender=self.rank == 0,
                                         specs=weight_specs(model, engine_dtype), device=self.device)
        return self._shared.fill_from(whole_tensors(model))

    def save_checkpoint(self, directory: str) -> None:
        from trainers.deepspeed.checkpointing import save_rank_checkpoint  # noqa: PLC0415

        save_rank_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from trainers.deepspeed.checkpointing import load_rank_checkpoint  # noqa: PLC0415

        load_rank_checkpoint(self, directory)
