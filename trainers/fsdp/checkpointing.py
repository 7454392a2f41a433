"""Resumable training checkpoints for FSDP2 ranks, without pickles: safetensors for tensors, JSON for the rest.

Layout of a checkpoint directory (written into a temporary directory and renamed by the caller):
  model.safetensors            the policy's full model state (rank 0)
  optimizer.safetensors        its AdamW moments, keyed "<param fqn>/<state key>" (rank 0); none for a parameter that
                               has had no gradient yet, which gets none at the load either (AdamW starts it fresh)
  optimizer.json               its param groups (hyper-parameters, parameter names)
  trainer.json                 its step, scheduler state
  <role>/...                   the same four files for every other trained role, and a value role's config.json (its
                               directory is then a value-model directory: critic.path may point at it)
  rng_rank{r}.safetensors/.json  each rank's RNG streams, in the directory of the rank's first role (a group holding
                               only the critic, placed apart from the policy's, writes them under critic/)
Full (gathered) state keeps the format simple and pickle-free; a sharded format is the next step at GLM-5 scale.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def jsonable(x):
    if isinstance(x, tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, list):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.item()
    return x


def _python_rng_from_json(state) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def role_directory(root: Path, name: str) -> Path:
    """Where a role's files go: the policy's at the top (the layout export and older checkpoints read)."""
    return root if name == "policy" else root / name


def rng_directory(root: Path, worker) -> Path:
    """Where a rank's RNG streams go: the directory of its first role."""
    return role_directory(root, next(iter(worker.roles)))


def save_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this; rank 0 writes the shared files."""
    out = Path(directory)
    for name, role in worker.roles.items():
        if role.optimizer is not None:
            _save_role(role, role_directory(out, name), worker.rank == 0)
    dist.barrier()
    save_rng_state(worker, out)
    dist.barrier()


def save_rng_state(worker, out: Path) -> None:
    """This rank's RNG streams (torch, CUDA, Python's random) under the directory of its first role."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    rng_dir = rng_directory(out, worker)
    rng_dir.mkdir(parents=True, exist_ok=True)
    save_file(rng, rng_dir / f"rng_rank{worker.rank}.safetensors")
    (rng_dir / f"rng_rank{worker.rank}.json").write_text(json.dumps({"python": jsonable(random.getstate())}))


def _stateless(role) -> dict[str, torch.nn.Parameter]:
    """The trained parameters AdamW holds no state for yet (none had a gradient): they have none in a checkpoint."""
    state = role.optimizer.state
    return {name: p for name, p in role.model.named_parameters() if p.requires_grad and not state.get(p)}


def _save_role(role, out: Path, writer: bool) -> None:
    model_state = get_model_state_dict(role.model, options=_FULL)  # collective: every rank gathers
    stateless = _stateless(role)
    optim_state = get_optimizer_state_dict(role.model, role.optimizer, options=_FULL)
    for p in stateless.values():  # torch steps an optimizer holding no state at all at lr 0 to create it: undone
        role.optimizer.state.pop(p, None)
    if not writer:
        return
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model_state.items()}, out / "model.safetensors")
    tensors = {f"{fqn}/{key}": value.detach().cpu().contiguous().reshape(value.shape)
               for fqn, entry in optim_state["state"].items() if fqn not in stateless
               for key, value in entry.items()}
    save_file(tensors, out / "optimizer.safetensors")
    (out / "optimizer.json").write_text(json.dumps({"param_groups": jsonable(optim_state["param_groups"])}))
    (out / "trainer.json").write_text(json.dumps({"step": role.step, "scheduler": jsonable(role.scheduler.state_dict())}))
    if role.config.kind == "value":
        role.model.config.save(out)  # architectures GlmMoeDsaForValue: a value-model directory


def load_rank_checkpoint(worker, directory: str) -> None:
    """Every rank calls this; each reads the full state and keeps its shard."""
    src = Path(directory)
    for name, role in worker.roles.items():
        if role.optimizer is not None:
            _load_role(role, role_directory(src, name))
    load_rng_state(worker, src)
    dist.barrier()


def load_rng_state(worker, src: Path) -> None:
    """The inverse of save_rng_state (nothing to do where the checkpoint has none for this rank)."""
    rng_dir = rng_directory(src, worker)
    rng_file = rng_dir / f"rng_rank{worker.rank}.safetensors"
    if rng_file.exists():
        rng = load_file(rng_file)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        random.setstate(_python_rng_from_json(json.loads((rng_dir / f"rng_rank{worker.rank}.json").read_text())["python"]))


def _load_role(role, src: Path) -> None:
    set_model_state_dict(role.model, load_file(src / "model.safetensors"), options=StateDictOptions(full_state_dict=True))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in load_file(src / "optimizer.safetensors").items():
        fqn, key = name.rsplit("/", 1)
        state.setdefault(fqn, {})[key] = value
    groups = json.loads((src / "optimizer.json").read_text())["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    trained = {name: p for name, p in role.model.named_parameters() if p.requires_grad}
    unknown = sorted(set(trained).difference(*(g["params"] for g in groups)))
    if unknown:
        raise ValueError(f"{src / 'optimizer.json'} lists no {unknown[0]} ({len(unknown)} parameters in all), which "
                         "this run trains: resume with the parameters frozen as in the run that saved")
    # strict=False: the parameters that had no gradient before the save have no state in it, and get none.
    set_optimizer_state_dict(role.model, role.optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True, strict=False))
    for name in trained.keys() - state.keys():  # what they hold now goes (in a fresh optimizer, a step at lr 0's)
        role.optimizer.state.pop(trained[name], None)
    trainer = json.loads((src / "trainer.json").read_text())
    role.step = trainer["step"]
    role.scheduler.load_state_dict(trainer["scheduler"])
