"""Convert a Hugging Face GLM-MoE-DSA directory into Megatron shards for trainer.backend megatron.

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR --tensor-parallel 2 --expert-parallel 4

OUT_DIR gets one directory per (tensor-parallel rank, expert-parallel rank), mp_rank_{tp:02d}_{ep:03d}/ with that
rank's model.safetensors (trainers/megatron/convert.py names), plus config.json, megatron.json (the sizes) and the
tokenizer files. tools/convert_megatron_to_hf.py is the inverse; a round trip is bit-exact. OUT_DIR is written beside
itself and renamed into place (slime_dsa/durable.py): a killed conversion leaves none; one over a previous OUT_DIR
replaces its shards and keeps the other files of it (a README). Ctrl-C or SIGTERM stops it with exit code 130,
leaving none either; an unwritable OUT_DIR or a full disk is one line naming OUT_DIR (exit code 2). A second
conversion or export into OUT_DIR while this one runs fails at once naming this one's pid; the next one after a
killed one removes what that one left beside OUT_DIR (slime_dsa/run_lock.py OutputLock).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from rollout.progress import SampleProgress
from slime_dsa import interrupts
from slime_dsa.checkpoint.hf_format import read_state_dict
from slime_dsa.checkpoint.validate import model_dir_problem
from slime_dsa.config.errors import UserError
from slime_dsa.durable import creation_problem, write_directory, write_failure
from slime_dsa.models.config import ModelConfig
from slime_dsa.models.parallel_layout import ParallelSizes, check_parallel_sizes
from slime_dsa.run_lock import OutputLock
from trainers.megatron.convert import hf_to_megatron

logger = logging.getLogger("convert_hf_to_megatron")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def shard_directory(root: Path, tp_rank: int, ep_rank: int) -> Path:
    return root / f"mp_rank_{tp_rank:02d}_{ep_rank:03d}"


def convert(src: Path, out: Path, tp: int, ep: int) -> None:
    """Write `src`'s weights as tp x ep Megatron shards, with its config and tokenizer, into `out`."""
    config = ModelConfig.from_pretrained(src)
    check_parallel_sizes(config, ParallelSizes(tensor_parallel=tp, expert_parallel=ep), tp * ep)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a directory to write the Megatron shards into")
    if problem := creation_problem(out):  # before minutes of reading a large model
        raise UserError(f"{out}: {problem}")
    if problem := model_dir_problem(src):  # a weight file cut short: named, not safetensors' traceback
        raise UserError(problem)
    # OutputLock: a second export or conversion into `out` fails at once, naming this one's pid. The progress bar:
    # on a terminal only: the read, each shard
    with OutputLock(out), SampleProgress("converting", total=1 + tp * ep) as progress:
        state = read_state_dict(src)
        progress.advance(1)

        def write(tmp: Path) -> None:
            for t in range(tp):
                for e in range(ep):
                    directory = shard_directory(tmp, t, e)
                    directory.mkdir()
                    save_file(hf_to_megatron(state, config, tp, ep, t, e), directory / "model.safetensors")
                    progress.advance(1)
            _copy_the_rest(src, tmp, tp, ep)

        _write(out, write, keep=lambda name: not name.startswith("mp_rank_"))
    logger.info("wrote %d shards to %s", tp * ep, out)


def _copy_the_rest(src: Path, tmp: Path, tp: int, ep: int) -> None:
    """config.json, megatron.json and the tokenizer files, beside the shards."""
    shutil.copy(src / "config.json", tmp / "config.json")
    (tmp / "megatron.json").write_text(json.dumps({"tensor_parallel": tp, "expert_parallel": ep}) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)


def _write(out: Path, write, keep) -> None:
    """durable.write_directory; a failed write (unwritable, under a file, a full disk) is one UserError naming `out`."""
    try:
        write_directory(out, write, keep=keep)
    except Exception as e:  # safetensors' own error says a full disk in words
        if (failure := write_failure(out, e)) is None:
            raise
        raise UserError(f"{out}: {failure}") from None


def _size(text: str) -> int:
    """A parallel size: an integer of 1 or more (argparse names the flag in its error)."""
    if not text.lstrip("-").isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--tensor-parallel", type=_size, default=1)
    parser.add_argument("--expert-parallel", type=_size, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # OSError: a source file unreadable (it names the file)
    return interrupts.run_writing(lambda: convert(args.src, args.out, args.tensor_parallel, args.expert_parallel), args.out, (ValueError, OSError, UserError))


if __name__ == "__main__":
    sys.exit(main())
