"""Resumable checkpoints of DeepSpeed ranks, without pickles, in FSDP2's layout (trainers/fsdp/checkpointing.py):
the same files and keys.

  model.safetensors      float32 master weights of the trainable parameters, the rest as the model holds them
  optimizer.safetensors  "<param>/exp_avg", "<param>/exp_avg_sq", "<param>/step" of every trainable parameter
  optimizer.json         each param group's hyper-parameters and parameter names
  trainer.json           the role's step and learning-rate schedule
ZeRO's partitions are read and written through DeepSpeed's tensor-fragment API (safe_get_full_* on every rank).
Its optimizer state is created by the first update, so a role that has not stepped yet gets a null update first:
zero gradients at learning rate 0 change no weight, and its step count is set back to 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainers.deepspeed.gather import set_full, whole_tensors, write_whole_tensors
from trainers.fsdp.checkpointing import jsonable, load_rng_state, role_directory, save_rng_state

MOMENTS = ("exp_avg", "exp_avg_sq")


def save_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this; rank 0 writes the shared files."""
    out = Path(directory)
    for name, role in worker.roles.items():
        _save_role(worker, name, role_directory(out, name))
    dist.barrier()
    save_rng_state(worker, out)
    dist.barrier()


def load_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this; each writes its partitions from the full tensors."""
    src = Path(directory)
    for name in worker.roles:
        _load_role(worker, name, role_directory(src, name))
    load_rng_state(worker, src)
    dist.barrier()


def _save_role(worker, name: str, out: Path) -> None:
    import deepspeed  # noqa: PLC0415

    held, built = worker.roles[name], worker.engines[name]
    model = held.model.module
    ensure_optimizer_state(worker, name)
    params = dict(model.named_parameters())
    writer = worker.rank == 0
    model_state, optim_state = {}, {}
    for key, tensor in whole_tensors(model):  # collective
        if writer:
            model_state[key] = tensor.to("cpu", copy=True)
    step = float(optimizer_step_count(built.basic_optimizer))
    for key, p in params.items():
        if not p.requires_grad:
            continue
        master = deepspeed.utils.safe_get_full_fp32_param(p)  # collective, as are the moments'
        moments = {m: deepspeed.utils.safe_get_full_optimizer_state(p, m) for m in MOMENTS}
        if writer:
            model_state[key] = master.to("cpu", copy=True)
            optim_state.update({f"{key}/{m}": v.to("cpu", copy=True) for m, v in moments.items()})
            optim_state[f"{key}/step"] = torch.tensor(step)
    if not writer:
        return
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model_state.items()}, out / "model.safetensors")
    save_file(optim_state, out / "optimizer.safetensors")
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(built.basic_optimizer.param_groups, built.group_names)]
    (out / "optimizer.json").write_text(json.dumps({"param_groups": jsonable(groups)}))
    (out / "trainer.json").write_text(json.dumps({"step": held.step, "scheduler": jsonable(held.scheduler.state_dict())}))
    if held.config.kind == "value":
        held.model.config.save(out)  # architectures GlmMoeDsaForValue: a value-model directory


def _load_role(worker, name: str, src: Path) -> None:
    held, built = worker.roles[name], worker.engines[name]
    model = held.model.module
    ensure_optimizer_state(worker, name)
    state = load_file(src / "model.safetensors")
    write_whole_tensors(model, state)
    optim = load_file(src / "optimizer.safetensors")
    for key, p in model.named_parameters():
        if not p.requires_grad:
            continue
        set_full(p, state[key], None)
        for m in MOMENTS:  # an FSDP2 checkpoint has none for a parameter without a gradient yet: AdamW's zeros
            set_full(p, optim.get(f"{key}/{m}", torch.zeros_like(state[key])), m)
    steps = {float(v) for k, v in optim.items() if k.endswith("/step")}
    set_optimizer_step_count(built.basic_optimizer, int(steps.pop()) if steps else 0)
    groups = json.loads((src / "optimizer.json").read_text())["param_groups"]
    for group, saved in zip(built.basic_optimizer.param_groups, groups):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items() if k != "params" and k in group})
    trainer = json.loads((src / "trainer.json").read_text())
    held.step = trainer["step"]
    held.scheduler.load_state_dict(trainer["scheduler"])


def optimizer_step_count(optimizer: torch.optim.Optimizer) -> int:
    """The update count AdamW's bias correction uses (every partition steps together)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def set_optimizer_step_count(optimizer: torch.optim.Optimizer, step: int) -> None:
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step


def ensure_optimizer_state(worker, name: str) -> None:
    """Create the role's optimizer state if no update has yet (see the module docstring), and link every parameter
    to its slice of it."""
    built = worker.engines[name]
    if not built.basic_optimizer.state:
        _null_update(worker, name)
    zero = built.engine.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked"):
        # Stages 1 and 2 link the parameters to the optimizer state once, right after the first param group's first
        # update, when the later groups have no state yet (their moments would be missing): link again now.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _null_update(worker, name: str) -> None:
    """One update of zero gradients at learning rate 0: DeepSpeed creates the optimizer state; no weight moves."""
    built = worker.engines[name]
    groups = built.basic_optimizer.param_groups
    rates = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    held = worker.roles[name]
    held.model.train()
    out = worker.forward(held, None) if held.config.kind == "policy" else worker.value_forward(held, None)
    worker.backward(held, out[0].sum() * 0.0)
    built.engine.step()
    for g, lr in zip(groups, rates):
        g["lr"] = lr
    set_optimizer_step_count(built.basic_optimizer, 0)
