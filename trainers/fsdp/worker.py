"""FSDP2 training ranks: the backend supplies model wrapping, optimizer, collectives and checkpoint format; the step
itself is trainers/rank.py's.

Built in a readable order in __init__: process group → mesh → each role's model → parallelise → optimiser →
scheduler. A group of one rank is not wrapped (nothing to shard) and uses fused AdamW; in bf16 mixed precision it
computes with a bf16 copy of its float32 weights (bf16_compute.py), which is what FSDP2 would compute there without
its per-parameter overhead. The ranks of data_parallel "replicate" are not wrapped either: they average their
gradients with one all-reduce per optimiser step. The same class runs as a Ray actor (trainers.fsdp.group) or
directly in a test process.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from slime_dsa import ops
from slime_dsa.checkpoint import load_model, load_value_model
from trainers.base import RankConfig, RoleConfig
from trainers.fsdp.bf16_compute import Bf16Compute
from trainers.fsdp.parallelize import apply_compile, apply_fsdp
from trainers.optim import build_role_optimizer, build_scheduler
from trainers.rank import Role, TrainerRank
from trainers.rendezvous import join_default_group
from trainers.shared_weights import SharedWeights
from trainers.weight_sender import write_safetensors

logger = logging.getLogger(__name__)

# The methods each model kind is entered through by the rank (FSDP gathers the root's weights in each).
ENTRY_POINTS = {"policy": ("token_logprobs", "token_logprobs_with_output"), "value": ("token_values",)}


class FSDPWorker(TrainerRank):
    """An FSDP2 rank (or a float32 replica). Call every collective method on every rank of the group."""

    reuses_first_forward = True
    warms_up_kernels = True

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config: RankConfig,
                 store_hosted: bool = False) -> None:
        super().__init__(rank, world_size, config)
        use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        join_default_group(rank, world_size, master_addr, master_port, self.device, store_hosted)
        self.mesh = torch.distributed.device_mesh.init_device_mesh(self.device.type, (world_size,))
        torch.manual_seed(config.seed)
        ops.set_backend(config.ops_backend)
        ops.invariant.set_enabled(config.true_on_policy)
        if config.data_parallel not in ("fsdp", "replicate"):
            raise ValueError(f"trainer.data_parallel must be fsdp or replicate, got {config.data_parallel!r}")
        if config.data_parallel == "replicate" and config.mixed_precision:
            raise ValueError("trainer.data_parallel: replicate trains in float32; bf16 mixed precision comes with "
                             "FSDP2 (data_parallel: fsdp)")
        self.mixed_precision = config.mixed_precision  # the recipe allows it on GPU trainers only; tests run it on CPU
        self.sharded = config.data_parallel == "fsdp" and world_size > 1
        self.bf16_copies: dict[str, Bf16Compute] = {}  # role name -> its bf16 compute copy (one mixed-precision rank)
        self.roles = {name: self._build_role(name, role) for name, role in config.roles.items()}
        self._shared: SharedWeights | None = None  # built by the first share_weights (rollout.weight_sync cuda_ipc)

    def _build_role(self, name: str, config: RoleConfig) -> Role:
        """Load the role's float32 weights, freeze what it keeps fixed, shard, and give it an optimizer if it trains.

        A value role loads a value model, or a policy's backbone under a fresh head seeded by the run's seed."""
        if config.kind == "value":
            model = load_value_model(config.model_path, dtype=torch.float32, device=self.device, seed=self.config.seed)
        else:
            model = load_model(config.model_path, dtype=torch.float32, device=self.device)
        model.gradient_checkpointing = self.config.gradient_checkpointing
        for param_name, p in model.named_parameters():
            if not config.trains or any(part in param_name for part in config.frozen):
                p.requires_grad_(False)
        if self.sharded:
            if self.config.compile:  # before FSDP2 wraps the layers, as torchtitan orders them
                apply_compile(model)
            model = apply_fsdp(model, self.mesh, self.mixed_precision, ENTRY_POINTS[config.kind])
        role = Role(config, model)
        if self.mixed_precision and not self.sharded:
            self.bf16_copies[name] = Bf16Compute(model)
            role.compute = self.bf16_copies[name].module
        if self.config.compile and not self.sharded:
            apply_compile(role.runs)  # the module that computes: a compiled forward would not follow a deep copy
        if config.trains:
            # Fused kernels for plain tensors (one rank): one pass over all parameters instead of ~10 ops each.
            role.optimizer = build_role_optimizer(model, config.optimizer, config.dsa.indexer_learning_rate,
                                                  fused=not self.sharded)
            opt = config.optimizer
            role.scheduler = build_scheduler(role.optimizer, opt.warmup_steps, opt.total_steps, opt.lr_schedule)
        return role

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        if not self.sharded and self.world_size > 1:
            average_gradients(params, self.world_size)

    def _bf16_copy(self, held: Role) -> Bf16Compute | None:
        return next((c for name, c in self.bf16_copies.items() if self.roles[name] is held), None)

    def zero_gradients(self, role: Role) -> None:
        if (copy := self._bf16_copy(role)) is not None:
            copy.zero_grad()  # every master parameter's: the optimizer's are among them
        else:
            super().zero_gradients(role)

    def backward(self, held: Role, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch; through a bf16 copy, its gradients are added to the master's in float32."""
        super().backward(held, loss)
        if (copy := self._bf16_copy(held)) is not None:
            copy.accumulate_gradients()

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Through a bf16 copy's flat gradient buffer where `params` are its master's, else torch's."""
        for copy in self.bf16_copies.values():
            if (norm := copy.clip_grad_norm(params, max_norm)) is not None:
                return norm
        return super().clip_grad_norm(params, max_norm)

    def apply_gradients(self, held: Role) -> torch.Tensor:
        grad_norm = super().apply_gradients(held)
        if (copy := self._bf16_copy(held)) is not None:
            copy.refresh()
        return grad_norm

    # -- weights and checkpoints ---------------------------------------------------------------

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor] | None:
        """The role's full (unsharded) float32 state dict on CPU on rank 0; None elsewhere. Collective."""
        model = self.roles[role].model
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.rank == 0 else None

    def save_weights(self, path: str, role: str = "policy") -> None:
        """Write the role's full state dict to the safetensors file `path` (rank 0), atomically. Collective."""
        # One unsharded rank: its own tensors, written at once (no gathered copy needed).
        model = self.roles[role].model
        state = self.full_state_dict(role) if self.sharded else {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        if self.rank == 0:
            write_safetensors(state, path)

    def share_weights(self, engine_dtype: str) -> dict | None:
        """The weights, cast to the engine's dtypes, in one buffer on rank 0's GPU that engines on that GPU open by
        CUDA IPC; rank 0 returns its JSON table (slime_dsa.weights.cuda_ipc), the others None. Collective."""
        if self._shared is None:
            if self.device.type != "cuda":
                raise RuntimeError("share_weights (rollout.weight_sync cuda_ipc) needs trainer ranks on CUDA devices")
            self._shared = SharedWeights(self.policy.model, engine_dtype, sender=self.rank == 0)
        return self._shared.fill(self.policy.model)

    def save_checkpoint(self, directory: str) -> None:
        """Sharded model + optimiser with torch.distributed.checkpoint, plus per-rank training state. Collective."""
        from trainers.fsdp.checkpointing import save_rank_checkpoint  # noqa: PLC0415

        save_rank_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from trainers.fsdp.checkpointing import load_rank_checkpoint  # noqa: PLC0415

        load_rank_checkpoint(self, directory)
        for copy in self.bf16_copies.values():
            copy.refresh()
        if self._shared is not None:
            self._shared.forget_sources()


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
