"""Run checkpoints: written atomically and durably (a temporary directory, fsynced, then a rename:
slime_dsa/durable.py), the last K kept, resumed exactly.

A checkpoint directory `step_000042/` holds the trainer's files (see trainers/fsdp/checkpointing.py), the model's
config.json and tokenizer (so it exports without the run), and `orchestrator.json` (data position, step, the size of
every file written and the SHA-256 of the small ones). `latest()` skips a checkpoint damaged since (validate.py) for
the newest intact one; `remove_orphans()` removes the temporary directories of saves that were killed, and puts back
a step's old checkpoint that a killed save of the same step had set aside (durable.publish_over).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from slime_dsa.checkpoint.validate import (CHECKSUM_KEY, MANIFEST_KEY, checkpoint_problem, checksums, manifest,
                                           model_dir_problem)
from slime_dsa.config.errors import UserError
from slime_dsa.durable import creation_problem, fsync_path, make_temp_dir, publish_over, write_failure

if TYPE_CHECKING:  # torch: only when a checkpoint is loaded
    from slime_dsa.checkpoint.hf_format import Progress

logger = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^\.step_\d+\.tmp-")
ASIDE_DIR = re.compile(r"^\.(step_\d+)\.old-\d+$")  # durable.aside_path of a step directory


class HeldLock(Protocol):
    """The run directory's lock (slime_dsa.run_lock.RunLock): only its holder removes temporary directories."""

    held: bool


class CheckpointManager:
    """Owns `<dir>/step_N` directories."""

    def __init__(self, directory: str | Path, keep_last: int = 2) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary directories are never listed)."""
        if not self.directory.exists():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest intact checkpoint; each damaged newer one is skipped with one WARNING saying what is wrong."""
        for ckpt in reversed(self.checkpoints()):
            problem = checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            logger.warning("checkpoint %s skipped: %s; falling back to the one before", ckpt, problem)
        return None

    def remove_orphans(self, lock: HeldLock) -> list[Path]:
        """Remove the temporary directories of saves that were killed, and the old checkpoints a save of the same step
        set aside; one whose step directory is missing (the save was killed before its rename) is renamed back. Only
        while holding the run directory's `lock`: without it, another run's save in progress would look orphaned."""
        if not getattr(lock, "held", False):
            raise RuntimeError("remove_orphans needs the run directory's lock held (slime_dsa.run_dir.held_lock)")
        if not self.directory.exists():
            return []
        self._restore_set_aside()
        orphans = sorted(p for p in self.directory.iterdir()
                         if p.is_dir() and (TMP_DIR.match(p.name) or ASIDE_DIR.match(p.name)))
        for orphan in orphans:
            shutil.rmtree(orphan, ignore_errors=True)
            logger.info("removed %s, left by a checkpoint save that did not finish", orphan)
        return orphans

    def _restore_set_aside(self) -> None:
        """Rename back each old checkpoint set aside by a save of its step that was killed before its rename."""
        for aside in sorted(p for p in self.directory.iterdir() if p.is_dir() and ASIDE_DIR.match(p.name)):
            final = self.directory / ASIDE_DIR.match(aside.name).group(1)
            if not final.exists():
                os.replace(aside, final)
                fsync_path(self.directory)
                logger.info("restored %s from %s, set aside by a save of its step that did not finish", final, aside)

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def save(self, step: int, write: Callable[[Path], None], orchestrator_state: dict[str, Any]) -> Path:
        """Run `write(tmp_dir)`, add orchestrator.json, fsync it all, rename into place and prune old checkpoints."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(self.path_for(step))  # .step_N.tmp-PID-RANDOM: an export into this directory reads the pid
        try:
            write(tmp)
            state = {"step": step, **orchestrator_state, MANIFEST_KEY: manifest(tmp), CHECKSUM_KEY: checksums(tmp)}
            (tmp / "orchestrator.json").write_text(json.dumps(state, indent=2))
            final = self.path_for(step)
            publish_over(tmp, final)  # a step saved again: the old one set aside, not deleted, until the new is in
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.checkpoints()[: -self.keep_last] if self.keep_last > 0 else []:
            self._prune(old)
        logger.info("checkpoint written: %s", final)
        return final

    def _prune(self, checkpoint: Path) -> None:
        """Delete an old checkpoint, renamed first to a temporary name: a kill while its files go leaves a directory
        that remove_orphans removes, not a half-deleted step_N."""
        doomed = checkpoint.with_name(f".{checkpoint.name}.tmp-pruned-{os.getpid()}")
        try:
            os.replace(checkpoint, doomed)
        except OSError as error:
            logger.warning("could not prune %s: %s", checkpoint, error)
            return
        shutil.rmtree(doomed, ignore_errors=True)


def read_orchestrator_state(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / "orchestrator.json"
    if not path.exists():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no orchestrator.json)")
    return json.loads(path.read_text())


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
                      progress: Progress | None = None) -> Path:
    """Write an HF directory (safetensors, config, tokenizer) that transformers and serving engines load as is;
    `progress` counts the load, the check of the weights and each weight file written.

    Refused with a one-line UserError: a path that is no checkpoint (a run directory: the error names its newest
    intact checkpoint), unreadable weight files, weights holding NaN or infinite values (naming the tensor), an
    out_dir that is the checkpoint itself, and an out_dir that cannot be written (a full disk)."""
    from slime_dsa.checkpoint.hf_format import CheckpointError, NoProgress, load_model, save_pretrained  # noqa: PLC0415

    checkpoint = Path(checkpoint)
    _check_exportable(checkpoint)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory to write the HF model into")
    if Path(out_dir).resolve() == checkpoint.resolve():  # its weights replaced: a checkpoint's manifest then fails
        raise UserError(f"--out {out_dir} is the directory being exported ({checkpoint}): export writes a new HF "
                        "directory; give another --out")
    if problem := creation_problem(Path(out_dir)):  # before minutes of loading a large model
        raise UserError(f"--out {out_dir}: {problem}")
    progress = progress or NoProgress()
    progress.add_total(2)  # the load and the check; save_pretrained adds its weight files
    try:
        model = load_model(checkpoint, dtype=dtype)
    except CheckpointError as e:  # a tensor missing, unexpected or misshapen: named
        raise UserError(f"{checkpoint}: {e}") from None
    progress.advance(1)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise UserError(f"{checkpoint}: tensor {name} holds NaN or infinite values; refusing to export it")
    progress.advance(1)
    try:
        return save_pretrained(model, out_dir, extra=lambda tmp: _copy_tokenizer(checkpoint, tmp), progress=progress)
    except Exception as e:  # --out under a file or unwritable, a full disk (safetensors' own error says it in words)
        if (failure := write_failure(Path(out_dir), e)) is None:
            raise
        raise UserError(f"--out {out_dir}: {failure}") from None


def _copy_tokenizer(checkpoint: Path, out: Path) -> None:
    """The tokenizer and generation files of `checkpoint` that an HF directory carries, copied into `out`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (checkpoint / name).exists():
            shutil.copy2(checkpoint / name, out / name)


def _check_exportable(checkpoint: Path) -> None:
    """Raise UserError unless `checkpoint` holds a config and readable weights."""
    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint} does not exist" if not checkpoint.exists() else f"{checkpoint} is a file, not a checkpoint directory")
    # optimizer.safetensors and rng_rank*.safetensors are no weights
    weights = [p for p in (checkpoint / "model.safetensors", checkpoint / "model.safetensors.index.json")
               if p.is_file()]
    if not weights or not (checkpoint / "config.json").is_file():
        if (checkpoint / "checkpoints").is_dir() or (checkpoint / "metrics.jsonl").is_file():
            manager = CheckpointManager(checkpoint / "checkpoints")
            intact = next((c for c in reversed(manager.checkpoints()) if checkpoint_problem(c) is None), None)
            hint = f"e.g. {intact}" if intact else f"but {manager.directory} holds no intact checkpoint"
            raise UserError(f"{checkpoint} is a run directory, not a checkpoint: export one of its checkpoints, {hint}")
        missing = "config.json" if weights else "model.safetensors"
        pickles = sorted(p.name for p in checkpoint.iterdir() if p.suffix in (".bin", ".pt", ".pkl"))
        hint = f" (pickled weights such as {pickles[0]} are never loaded)" if pickles and not weights else ""
        raise UserError(f"{checkpoint} holds no {missing}{hint}: is it a slime-dsa checkpoint or model directory?")
    from slime_dsa.models.value_model import VALUE_ARCHITECTURE, is_value_model_dir  # noqa: PLC0415

    if is_value_model_dir(checkpoint):  # an unreadable config.json: model_dir_problem below names it
        raise UserError(f"{checkpoint} is a value model ({VALUE_ARCHITECTURE}, a checkpoint's critic/), not a policy: "
                        "export writes a policy (export the checkpoint itself); critic.path loads this directory as "
                        "it is")
    if problem := model_dir_problem(checkpoint):  # config.json unreadable, a safetensors file truncated
        raise UserError(problem)
