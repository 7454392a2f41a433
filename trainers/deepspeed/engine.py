"""One role's DeepSpeed engine: the model partitioned by ZeRO, its optimizer, and the entry the shared step calls.

Built in a readable order: the model loaded on the host (ZeRO-3) or the device → parameters frozen → torch AdamW
over the whole tensors (its param groups split by tensor rank) → ZeRO-3 partitions the parameters at once (never
all of them on the device) → deepspeed.initialize. The trainer enters the model through methods other than forward
(token_logprobs_with_output, token_values); `Entry` turns each into one call of the engine's forward, where ZeRO-3
gathers parameters and finds those read outside their module's forward (lm_head.weight in the chunked log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from slime_dsa.models.glm_moe_dsa import Experts
from trainers.base import RoleConfig
from trainers.deepspeed.config import DeepSpeedOptions
from trainers.deepspeed.gather import set_full
from trainers.optim import build_role_optimizer


class Entry(nn.Module):
    """The module DeepSpeed wraps: one forward that runs any entry method of the model by name."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.model, method)(*args, **kwargs)


class EngineModel:
    """The model as the shared step holds it (Role.model): entry methods run through the engine, the rest is the
    model's own (config, parameters)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.module: nn.Module = engine.module.model
        self.config = self.module.config

    def token_logprobs_with_output(self, *args: Any, **kwargs: Any):
        return self.engine("token_logprobs_with_output", *args, **kwargs)

    def token_logprobs(self, *args: Any, **kwargs: Any):
        return self.engine("token_logprobs", *args, **kwargs)

    def token_values(self, *args: Any, **kwargs: Any):
        return self.engine("token_values", *args, **kwargs)

    def train(self, mode: bool = True) -> "EngineModel":
        self.engine.train(mode)
        return self

    def eval(self) -> "EngineModel":
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()


@dataclass
class BuiltEngine:
    """An engine with what the rank needs beside it: the torch optimizer inside it and each param group's names."""

    engine: Any  # deepspeed.DeepSpeedEngine
    basic_optimizer: torch.optim.Optimizer  # the torch (or DeepSpeed CPU) Adam that ZeRO drives
    group_names: list[list[str]]  # parameter names of each of basic_optimizer's param groups, in order


def skip_shared_memory_comm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce when it starts its comm backend on CPU (about
    25 s a process, more on a busy machine). That op only serves DeepSpeed-Inference's tensor-parallel all-reduce;
    training reduces through torch.distributed (gloo), so marking it unbuildable changes nothing else."""
    import deepspeed.ops  # noqa: PLC0415
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # noqa: PLC0415

    # DeepSpeed probes op compatibility once per process into this dict and reads it back before each build.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def build_engine(load: Callable[[torch.device], nn.Module], role: RoleConfig, ds_config: dict,
                 options: DeepSpeedOptions, device: torch.device) -> BuiltEngine:
    """`load(device)` gives the role's float32 model; ZeRO-3 loads it on the host and partitions it before it
    reaches the device (or `load` builds it under deepspeed.zero.Init, partitioned from the start)."""
    import deepspeed  # noqa: PLC0415

    stage3 = options.zero_stage == 3
    model = load(torch.device("cpu") if stage3 else device)
    for name, p in model.named_parameters():
        if any(part in name for part in role.frozen):
            p.requires_grad_(False)
    names = {id(p): name for name, p in model.named_parameters()}
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())  # built under deepspeed.zero.Init
    masters = None
    if ds_config["bf16"]["enabled"] and not partitioned:
        # DeepSpeed derives its float32 master weights from the bf16 copy it casts the model to: keep the
        # checkpoint's float32 values to start them from, as FSDP2's float32 parameters do.
        masters = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}
    basic = _optimizer(model, role, options)
    group_names = [[names[id(p)] for p in g["params"]] for g in basic.param_groups]  # before ZeRO swaps in partitions
    entry = Entry(model)
    if stage3:
        # MoE: every expert's weights are gathered when the experts module starts; its grouped GEMM reads them all
        # without calling each expert, and the loop skips experts no token reached (ranks would disagree).
        deepspeed.utils.set_z3_leaf_modules(entry, [Experts], raise_if_not_found=False)  # a dense model has none
        if not partitioned:
            if masters is not None:  # zero.Init(module=) partitions parameters as they are: cast them first (not buffers)
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            deepspeed.zero.Init(module=entry, config_dict_or_path=ds_config)  # offload_param: where partitions live
        _move_buffers(model, device)  # ZeRO-3 places parameters only: the router's bias would stay on the host
    engine, *_ = deepspeed.initialize(model=entry, optimizer=basic, config=ds_config, dist_init_required=False)
    for name, p in model.named_parameters():
        if masters is not None and name in masters:
            set_full(p, masters.pop(name), None)
    return BuiltEngine(engine, basic, group_names)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _optimizer(model: nn.Module, role: RoleConfig, options: DeepSpeedOptions) -> torch.optim.Optimizer:
    """torch's AdamW with the role's param groups, or DeepSpeed's CPU Adam (decoupled weight decay) over the same."""
    adamw = build_role_optimizer(model, role.optimizer, role.dsa.indexer_learning_rate)
    if not options.cpu_adam:
        return adamw
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

    opt = role.optimizer
    groups = [{k: v for k, v in g.items() if k in ("params", "lr", "weight_decay")} for g in adamw.param_groups]
    return DeepSpeedCPUAdam(groups, lr=opt.learning_rate, betas=tuple(opt.adam_betas), eps=1e-8,
                            weight_decay=opt.weight_decay, adamw_mode=True)
