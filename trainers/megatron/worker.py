"""Megatron training ranks: the backend supplies model wrapping (megatron's DDP over MegatronGlmMoeDsa), the
optimizer, the collectives (the data-parallel group) and its checkpoint format; the step is trainers/rank.py's.

Built in a readable order in __init__: process group → megatron's model-parallel groups → each role's model
(HF weights sharded by convert.py) → DDP (gradients into its float32 buffers after each backward: main_grads.py) →
optimizer → scheduler. On a GPU the optimizer is megatron's DistributedOptimizer (bf16 parameters, float32 main
weights sharded over data parallel); on a CPU, where that one needs CUDA, megatron's DDP plus torch's AdamW
(cpu_shim.py makes megatron-core run there).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter

from slime_dsa import ops
from slime_dsa.checkpoint.hf_format import read_state_dict
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.glm_moe_dsa import cast_keeping_float32, float32_modules
from slime_dsa.models.parallel_layout import ParallelSizes, check_parallel_sizes
from trainers.base import RankConfig, RoleConfig
from trainers.megatron import cpu_shim
from trainers.megatron.convert import hf_to_megatron
from trainers.megatron.main_grads import ForeachMainGradDDP
from trainers.megatron.model import MegatronGlmMoeDsa
from trainers.megatron.parallel import RankPlace, initialize, parallel_sizes
from trainers.megatron.transformer_config import transformer_config
from trainers.megatron.weights import gather_hf_state, load_shard
from trainers.optim import build_role_optimizer, build_scheduler
from trainers.rank import Role, TrainerRank
from trainers.rendezvous import join_default_group
from trainers.weight_sender import write_safetensors

logger = logging.getLogger(__name__)


class MegatronWorker(TrainerRank):
    """A Megatron rank. Call every collective method on every rank of the group."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config: RankConfig,
                 store_hosted: bool = False) -> None:
        super().__init__(rank, world_size, config)
        if config.compile:  # the recipe refuses it; a RankConfig built by hand must not be ignored
            raise ValueError("trainer.compile is built for the fsdp backend, not megatron")
        use_cuda = torch.cuda.is_available()
        cpu_shim.apply()  # a no-op on a GPU machine
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        join_default_group(rank, world_size, master_addr, master_port, self.device, store_hosted)
        self.sizes = parallel_sizes(config.backend_options)
        self.groups, self.place = initialize(self.sizes)
        self.data_parallel_rank, self.data_parallel_size = self.place.dp_rank, self.place.dp_size
        torch.manual_seed(config.seed)
        if use_cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415

            model_parallel_cuda_manual_seed(config.seed)
        ops.set_backend(config.ops_backend)
        self.dtype = torch.bfloat16 if config.mixed_precision and use_cuda else torch.float32
        self.distributed_optimizer = use_cuda  # megatron's DistributedOptimizer allocates on CUDA
        self.ddp: dict[str, ForeachMainGradDDP] = {}
        self.roles = {name: self._build_role(name, role) for name, role in config.roles.items()}

    def _build_role(self, name: str, config: RoleConfig) -> Role:
        """Shard the role's HF weights onto this rank, freeze what stays fixed, wrap in DDP, build its optimizer."""
        if config.kind != "policy":
            raise ValueError(f"trainer.backend megatron trains the policy only; role {name!r} (kind {config.kind}, "
                             "a value model) needs trainer.backend fsdp")
        check_parallel_sizes(ModelConfig.from_pretrained(config.model_path), self.sizes, self.world_size)
        model = load_model(config.model_path, self.sizes, self.groups, self.place, self.dtype, self.device)
        model.gradient_checkpointing = self.config.gradient_checkpointing
        for pname, p in model.named_parameters():
            if not config.trains or any(part in pname for part in config.frozen):
                p.requires_grad_(False)
        role = Role(config, model)
        if not config.trains:
            return role
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self.distributed_optimizer)
        self.ddp[name] = ForeachMainGradDDP(model.megatron, ddp_config, model, pg_collection=self.groups)
        opt = config.optimizer
        if self.distributed_optimizer:
            from trainers.megatron.optimizer import DistributedAdam, LambdaSchedule  # noqa: PLC0415

            role.optimizer = DistributedAdam(self.ddp[name], opt, config.dsa.indexer_learning_rate, self.dtype)
            role.scheduler = LambdaSchedule(role.optimizer, opt.warmup_steps, opt.total_steps, opt.lr_schedule)
        else:
            role.optimizer = build_role_optimizer(model, opt, config.dsa.indexer_learning_rate)
            role.scheduler = build_scheduler(role.optimizer, opt.warmup_steps, opt.total_steps, opt.lr_schedule)
        return role

    # -- the shared step's hooks ---------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """Over the data-parallel group: tensor-parallel peers hold the same samples and the same metrics."""
        dist.all_reduce(tensor, op=op, group=parallel_state.get_data_parallel_group())

    def backward(self, held: Role, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch, then add its gradients into DDP's float32 main gradients."""
        super().backward(held, loss)
        for name, role in self.roles.items():
            if role is held and name in self.ddp:
                self.ddp[name].accumulate_main_grads()

    def zero_gradients(self, role: Role) -> None:
        """Megatron's DDP accumulates into its own buffers (param.main_grad): zero those too."""
        for name, held in self.roles.items():
            if held is role and name in self.ddp:
                self.ddp[name].zero_grad_buffer()
        role.optimizer.zero_grad(set_to_none=True)

    def finish_gradients(self, params: list[torch.Tensor]) -> None:
        """Megatron's finalize: DP all-reduce of the buffers (experts over their own DP group), TP all-reduce of
        the sequence-parallel (partial) gradients; torch's optimizer then reads them as .grad."""
        for ddp in self.ddp.values():
            if any(p is params[0] for p in ddp.module.parameters()):
                finalize_model_grads([ddp], pg_collection=None)
        if not self.distributed_optimizer:
            for p in params:
                p.grad = p.main_grad

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every rank's shards (replicated tensors counted once)."""
        role = next(r for r in self.roles.values() if r.optimizer is not None and _holds(r.model, params))
        if hasattr(role.optimizer, "clip"):  # DistributedAdam computes it on its float32 main gradients
            return role.optimizer.clip(max_norm)
        return _clip_model_parallel(params, max_norm)

    # -- weights and checkpoints ---------------------------------------------------------------------

    def full_state_dict(self, role: str = "policy") -> dict[str, torch.Tensor] | None:
        """The role's full float32 HF state dict on CPU on rank 0; None elsewhere. Collective."""
        held = self.roles[role]
        state = gather_hf_state(held.model, held.model.config)
        return state if self.rank == 0 else None

    def save_weights(self, path: str, role: str = "policy") -> None:
        """Rank 0 writes the role's full HF state dict to the safetensors file `path`, atomically. Collective."""
        state = self.full_state_dict(role)
        if self.rank == 0:
            write_safetensors(state, path)

    def weight_buckets(self, engine_dtype, bucket_bytes):
        raise RuntimeError("rollout.sglang.weight_sync distributed is not built for trainer.backend megatron yet; "
                           "use disk")

    def cuda_device(self) -> str | None:
        """None: these ranks share no weights by CUDA IPC (share_weights is not built), so weight_sync auto picks shm
        or http."""
        return None

    def share_weights(self, engine_dtype: str) -> dict | None:
        raise RuntimeError("rollout.weight_sync cuda_ipc is not built for trainer.backend megatron yet; use http or "
                           "disk")

    def save_checkpoint(self, directory: str) -> None:
        """Every rank's own shards and optimizer state, rank 0's full HF model for export. Collective."""
        from trainers.megatron.checkpointing import save_rank_checkpoint  # noqa: PLC0415

        save_rank_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        from trainers.megatron.checkpointing import load_rank_checkpoint  # noqa: PLC0415

        load_rank_checkpoint(self, directory)

    def shutdown(self) -> None:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().shutdown()


def load_model(model_path: str, sizes: ParallelSizes, groups: ProcessGroupCollection, place: RankPlace,
               dtype: torch.dtype, device: torch.device) -> MegatronGlmMoeDsa:
    """This rank's shards of the HF checkpoint at model_path as a MegatronGlmMoeDsa in `dtype`, but for the routers
    (weight and expert_bias) and indexer heads: float32 with the checkpoint's values, as
    GlmMoeDsaPreTrainedModel.cast holds them for the engine (cast first, then loaded: nothing rounds them)."""
    model_config = ModelConfig.from_pretrained(model_path)
    model = MegatronGlmMoeDsa(model_config, transformer_config(model_config, sizes, dtype), groups)
    model.to(device)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    cast_keeping_float32(model, dtype, routers + float32_modules(model))  # megatron's layers are built in dtype
    hf = {k: v.float() for k, v in read_state_dict(model_path).items()}
    load_shard(model, hf_to_megatron(hf, model_config, sizes.tensor_parallel, sizes.expert_parallel, place.tp_rank,
                                     place.ep_rank))
    return model


def _holds(model: torch.nn.Module, params: list[torch.Tensor]) -> bool:
    return bool(params) and any(p is params[0] for p in model.parameters())


def _clip_model_parallel(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over sharded parameters, by megatron's rule (get_grad_norm_fp32): TP-split tensors
    counted on every TP rank and replicated ones on TP rank 0, summed over the model-parallel group; experts
    (megatron's allreduce=False) summed over the expert-parallel group."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate  # noqa: PLC0415

    with_grad = [p for p in params if p.grad is not None]
    dense = torch.zeros((), dtype=torch.float64, device=with_grad[0].device if with_grad else "cpu")
    experts = torch.zeros_like(dense)
    for p in with_grad:
        square = p.grad.double().pow(2).sum()
        if not getattr(p, "allreduce", True):
            experts += square
        elif param_is_not_tensor_parallel_duplicate(p):
            dense += square
    dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    dist.all_reduce(experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    norm = (dense + experts).sqrt().float()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in with_grad:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm
