"""Resumable checkpoints of Megatron ranks, without pickles: safetensors for tensors, JSON for the rest.

Layout of a checkpoint directory (the policy's role; the backend holds no other):
  model.safetensors                 the full model with HF names (rank 0): what export and engines read
  megatron/rank{r}.safetensors      rank r's own shards (Megatron names), its optimizer state ("optim/<param>/<key>")
                                    and RNG states (CPU; on GPUs also CUDA's and megatron's tracker's)
  megatron/rank{r}.json             its param groups, step, scheduler, Python RNG, which optimizer, the world size and
                                    the parallel sizes (a resume must use the same ones)

The optimizer state is torch AdamW's on CPU ranks (exp_avg, exp_avg_sq, step per parameter); on GPU ranks this
rank's shard of megatron's DistributedOptimizer (the float32 main weight "main_param" too; optimizer.py).
The run's checkpoint writer makes the directory atomic and records every file's size (slime_dsa.checkpoint).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainers.megatron.weights import gather_hf_state, load_shard, local_state


def _jsonable(x):
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.item()
    return x


def _layout(worker) -> dict:
    return {"optimizer": "distributed" if worker.distributed_optimizer else "torch", "world_size": worker.world_size,
            "sizes": worker.sizes.__dict__}


def save_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this."""
    out, role = Path(directory), worker.policy
    state = gather_hf_state(role.model, role.model.config)
    if worker.rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    tensors = {f"model/{k}": v.to("cpu", copy=True) for k, v in local_state(role.model).items()}
    if worker.distributed_optimizer:
        optim, groups = role.optimizer.state()
        meta = {"param_groups": _jsonable(groups)}
    else:
        optim, meta = _torch_optimizer_state(role)
    tensors.update({f"optim/{k}": v for k, v in optim.items()})
    tensors.update(_rng_tensors(worker.device))
    meta.update(_layout(worker), step=role.step, scheduler=_jsonable(role.scheduler.state_dict()),
                python_rng=_jsonable(random.getstate()))
    (out / "megatron").mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "megatron" / f"rank{worker.rank}.safetensors")
    (out / "megatron" / f"rank{worker.rank}.json").write_text(json.dumps(meta))
    dist.barrier()


def load_rank_checkpoint(worker, directory: str) -> None:
    """Every rank reads its own files back; training continues exactly."""
    src, role = Path(directory) / "megatron", worker.policy
    meta = json.loads((src / f"rank{worker.rank}.json").read_text())
    saved = {k: meta.get(k) for k in ("optimizer", "world_size", "sizes")}
    if saved != _layout(worker):
        raise ValueError(f"the checkpoint was written by {saved['world_size']} ranks with trainer.megatron "
                         f"{saved['sizes']} and the {saved['optimizer']} optimizer; this run has {_layout(worker)}: "
                         "resume with the same trainer.num_workers, trainer.megatron and devices")
    tensors = load_file(src / f"rank{worker.rank}.safetensors")
    load_shard(role.model, {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    optim = {k[len("optim/"):]: v for k, v in tensors.items() if k.startswith("optim/")}
    if worker.distributed_optimizer:
        role.optimizer.load_state(optim, meta["param_groups"])
    else:
        _load_torch_optimizer_state(role, optim, meta)
    role.step = meta["step"]
    role.scheduler.load_state_dict(meta["scheduler"])
    _set_rng(tensors)
    version, internal, gauss = meta["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    dist.barrier()


def _torch_optimizer_state(role) -> tuple[dict[str, torch.Tensor], dict]:
    """torch AdamW's state by "<param>/<key>", and its param groups with the parameters' names in its order."""
    names = {id(p): n for n, p in role.model.named_parameters()}
    optim = role.optimizer.state_dict()
    params = [p for group in role.optimizer.param_groups for p in group["params"]]
    tensors = {f"{names[id(params[index])]}/{key}": value.detach().to("cpu", copy=True)
               for index, entry in optim["state"].items() for key, value in entry.items()}
    return tensors, {"param_groups": _jsonable(optim["param_groups"]), "param_names": [names[id(p)] for p in params]}


def _load_torch_optimizer_state(role, optim: dict[str, torch.Tensor], meta: dict) -> None:
    index = {name: i for i, name in enumerate(meta["param_names"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in optim.items():
        name, _, field = key.rpartition("/")
        state.setdefault(index[name], {})[field] = value
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    role.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    """torch's CPU generator; on a GPU also its CUDA generator and megatron's tracked CUDA states (dropout, init)."""
    out = {"rng/torch": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker  # noqa: PLC0415

        out["rng/cuda"] = torch.cuda.get_rng_state(device)
        for name, state in get_cuda_rng_tracker().get_states().items():
            out[f"rng/megatron/{name}"] = (state.get_state() if isinstance(state, torch.Generator) else state).clone()
    return out


def _set_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    if "rng/cuda" in tensors:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker  # noqa: PLC0415

        torch.cuda.set_rng_state(tensors["rng/cuda"], torch.cuda.current_device())
        prefix = "rng/megatron/"
        get_cuda_rng_tracker().set_states({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
