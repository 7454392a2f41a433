"""Convert Megatron shards (tools/convert_hf_to_megatron.py's layout) back into a Hugging Face directory that
transformers, SGLang and our engine load as it is.

    python tools/convert_megatron_to_hf.py MEGATRON_DIR HF_DIR

HF_DIR is written beside itself and renamed into place (slime_dsa/durable.py): a killed conversion leaves none; one
over a previous HF_DIR replaces its weights and keeps the other files of it (a README). Ctrl-C or SIGTERM stops it
with exit code 130, leaving none either; an unwritable HF_DIR or a full disk is one line naming HF_DIR (exit code 2).
A second conversion or export into HF_DIR while this one runs fails at once naming this one's pid; the next one
after a killed one removes what that one left beside HF_DIR (slime_dsa/run_lock.py OutputLock).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from rollout.progress import SampleProgress
from slime_dsa import interrupts
from slime_dsa.checkpoint.hf_format import is_weight_file
from slime_dsa.checkpoint.validate import safetensors_problem
from slime_dsa.config.errors import UserError
from slime_dsa.durable import creation_problem, write_directory, write_failure
from slime_dsa.models.config import ModelConfig
from slime_dsa.run_lock import OutputLock
from trainers.megatron.convert import megatron_to_hf

logger = logging.getLogger("convert_megatron_to_hf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def convert(src: Path, out: Path) -> None:
    """Write the HF directory of `src`'s Megatron shards (its config and tokenizer with it) into `out`."""
    if not (src / "megatron.json").is_file():
        raise UserError(f"{src} holds no megatron.json: is it a directory written by tools/convert_hf_to_megatron.py?")
    sizes = json.loads((src / "megatron.json").read_text())
    tp, ep = sizes["tensor_parallel"], sizes["expert_parallel"]
    config = ModelConfig.from_pretrained(src)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a directory to write the HF model into")
    if problem := creation_problem(out):  # before minutes of reading a large model
        raise UserError(f"{out}: {problem}")
    # OutputLock: a second export or conversion into `out` fails at once, naming this one's pid. The progress bar:
    # on a terminal only: each shard, the write
    with OutputLock(out), SampleProgress("converting", total=tp * ep + 1) as progress:
        shards = {}
        for t in range(tp):
            for e in range(ep):
                path = src / f"mp_rank_{t:02d}_{e:03d}" / "model.safetensors"
                if problem := safetensors_problem(path):  # cut short, or missing: named
                    raise UserError(f"{path} {problem}")
                shards[t, e] = load_file(path)
                progress.advance(1)

        def write(tmp: Path) -> None:
            save_file(megatron_to_hf(shards, config, tp, ep), tmp / "model.safetensors", metadata={"format": "pt"})
            progress.advance(1)
            shutil.copy(src / "config.json", tmp / "config.json")
            for name in TOKENIZER_FILES:
                if (src / name).exists():
                    shutil.copy(src / name, tmp / name)

        try:
            write_directory(out, write, keep=lambda name: not is_weight_file(name))
        except Exception as e:  # unwritable, under a file, a full disk (safetensors' own error says it in words)
            if (failure := write_failure(out, e)) is None:
                raise
            raise UserError(f"{out}: {failure}") from None
    logger.info("wrote %s", out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="directory written by tools/convert_hf_to_megatron.py")
    parser.add_argument("out", type=Path, help="output Hugging Face directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # OSError: a source file unreadable (it names the file)
    return interrupts.run_writing(lambda: convert(args.src, args.out), args.out, (ValueError, KeyError, OSError, UserError))


if __name__ == "__main__":
    sys.exit(main())
