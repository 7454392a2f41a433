"""`slime-dsa export` and tools/convert_*.py as a user meets them when the output cannot be written (a read-only
directory, a path under a file, a full disk) or the work is interrupted (Ctrl-C): one line naming the path and the
problem, a non-zero exit code, no traceback, and no output left that looks complete. Each runs the real command in a
subprocess; a full disk and Ctrl-C are made by a wrapper (WRAPPER) that replaces safetensors' save_file before the
command imports it."""

from __future__ import annotations

import importlib.util
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ASSET = ROOT / "recipes" / "assets" / "quickstart-sft"

# python WRAPPER MODE WHEN SCRIPT ARGS...: runs SCRIPT (a path, or -m MODULE) with safetensors' save_file failing
# after WHEN good calls (a number), or on the files whose path holds WHEN (a text): "enospc" writes part of the
# file, then raises what safetensors raises on a full disk; "sigint" sends this process SIGINT (Ctrl-C) from inside
# the write ("sigterm": SIGTERM, a scheduler's stop). A file, not `python -c`: a KeyboardInterrupt leaving code
# compiled from a string is marked unhandled by CPython (slime_dsa/interrupts.py).
WRAPPER = """
import os, runpy, signal, sys
import safetensors, safetensors.torch

mode, when, target, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
after = int(when) if when.isdigit() else 0
real_save_file, calls = safetensors.torch.save_file, []

def save_file(tensors, filename, metadata=None):
    calls.append(filename)
    failing = len(calls) > after if when.isdigit() else when in str(filename)
    if failing and mode == "enospc":
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise safetensors.SafetensorError(
            f'Error while serializing: I/O error: No space left on device (os error 28) at path "{filename}"')
    real_save_file(tensors, filename, metadata=metadata)
    if failing and mode in ("sigint", "sigterm"):
        os.kill(os.getpid(), signal.SIGINT if mode == "sigint" else signal.SIGTERM)

safetensors.torch.save_file = save_file
if target == "-m":
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = [target, *argv]
    runpy.run_path(target, run_name="__main__")
"""
TOOLS = ROOT / "tools"


def _run(args: list[str], wrap: tuple[str, int | str] | None = None, tmp_path: Path | None = None,
         cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `args` (a tool's path or -m MODULE, then its arguments) with this interpreter, stdout and stderr piped;
    `env` adds to the environment."""
    if wrap is not None:
        wrapper = tmp_path / "wrapper.py"
        wrapper.write_text(WRAPPER)
        args = [str(wrapper), wrap[0], str(wrap[1]), *args]
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=300)


def _export(out: Path) -> list[str]:
    return ["-m", "slime_dsa.cli", "export", str(ASSET), "--out", str(out)]


def _to_megatron(out: Path) -> list[str]:
    return [str(TOOLS / "convert_hf_to_megatron.py"), str(ASSET), str(out), "--expert-parallel", "2"]


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory) -> Path:
    """ASSET as Megatron shards, expert-parallel 2."""
    out = tmp_path_factory.mktemp("converted") / "megatron"
    done = _run(_to_megatron(out))
    assert done.returncode == 0, done.stderr
    return out


def _to_hf(megatron: Path, out: Path) -> list[str]:
    return [str(TOOLS / "convert_megatron_to_hf.py"), str(megatron), str(out)]


def _one_line(done: subprocess.CompletedProcess, *words: str, last: bool = False) -> str:
    """The single line of stderr (`last`: its last line), which names each of `words`; no traceback."""
    lines = done.stderr.strip().splitlines()[-1:] if last else done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create entries in: a 0500 directory, or, for root (whom modes do not stop), a
    directory of a read-only filesystem (sysfs)."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o500)
    probe = directory / "probe"
    try:
        probe.mkdir()
    except PermissionError:
        return directory
    probe.rmdir()
    for candidate in (Path("/sys/kernel"), Path("/sys")):
        try:
            (candidate / ".slime-dsa-probe").mkdir()
        except OSError:
            if candidate.is_dir():
                return candidate
        else:
            (candidate / ".slime-dsa-probe").rmdir()
    pytest.skip("running as root, and no read-only directory found to stand for an unwritable one")


def _commands(kind: str, tmp_path: Path, megatron_dir: Path, out: Path) -> list[str]:
    return {"export": _export, "to_megatron": _to_megatron, "to_hf": lambda o: _to_hf(megatron_dir, o)}[kind](out)


KINDS = ["export", "to_megatron", "to_hf"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_unwritable_output_directory_is_one_line(tmp_path, megatron_dir, kind):
    """The output's parent cannot be written: one line naming the path. Before, the tools printed mkdtemp's
    PermissionError traceback (their main caught ValueError and FileNotFoundError only)."""
    out = _unwritable_directory(tmp_path) / "model"
    done = _run(_commands(kind, tmp_path, megatron_dir, out))
    assert done.returncode != 0
    _one_line(done, str(out))
    assert not out.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_an_output_under_a_file_is_one_line_naming_the_file(tmp_path, megatron_dir, kind):
    """OUT is NOTES/model where NOTES is a file: one line naming NOTES as a file. Before, the tools printed a
    FileExistsError traceback and export said only "File exists"."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    done = _run(_commands(kind, tmp_path, megatron_dir, notes / "model"))
    assert done.returncode != 0
    assert "is a file" in _one_line(done, str(notes))
    assert notes.read_text() == "mine"


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_is_one_line_and_leaves_no_output(tmp_path, megatron_dir, kind):
    """The disk fills up while the weights are written: one line naming OUT and "No space left on device", nothing
    left beside OUT. Before, safetensors' SafetensorError (no OSError) reached the console as a traceback, from export
    as from the tools."""
    out = tmp_path / "out"
    done = _run(_commands(kind, tmp_path, megatron_dir, out), wrap=("enospc", 0), tmp_path=tmp_path)
    assert done.returncode != 0
    _one_line(done, str(out), "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrapper.py"]


@pytest.mark.parametrize("kind", KINDS)
def test_ctrl_c_while_writing_exits_130_in_one_line_and_leaves_no_output(tmp_path, megatron_dir, kind):
    """SIGINT arrives once the first weight file is written: exit code 130, one line, no temporary directory left
    and no OUT. Before, the tools printed KeyboardInterrupt's traceback."""
    out = tmp_path / "out"
    done = _run(_commands(kind, tmp_path, megatron_dir, out), wrap=("sigint", 0), tmp_path=tmp_path)
    assert done.returncode == 130, done.stderr
    assert "interrupted" in _one_line(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrapper.py"]


@pytest.mark.parametrize("kind", KINDS)
def test_sigterm_while_writing_exits_130_in_one_line_and_leaves_no_output(tmp_path, megatron_dir, kind):
    """SIGTERM (`kill`, a scheduler's stop) once the first weight file is written: as Ctrl-C. Before, the tools died at
    once (exit -15) and left their hidden temporary directory, a partial copy of the model, beside OUT."""
    out = tmp_path / "out"
    done = _run(_commands(kind, tmp_path, megatron_dir, out), wrap=("sigterm", 0), tmp_path=tmp_path)
    assert done.returncode == 130, done.stderr
    assert "interrupted" in _one_line(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wrapper.py"]


def test_ctrl_c_over_a_previous_output_leaves_it_whole(tmp_path, megatron_dir):
    """Interrupted while converting over an earlier output: the earlier one is left byte for byte, nothing beside it."""
    out = tmp_path / "out"
    assert _run(_to_hf(megatron_dir, out)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    done = _run(_to_hf(megatron_dir, out), wrap=("sigint", 0), tmp_path=tmp_path)
    assert done.returncode == 130, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "wrapper.py"]


# sft and indexer-warmup of two steps on the tiny models (tests/test_checkpoint_durability.py's)
DATA = {"tasks": [{"kind": "arithmetic", "eval_size": 4, "train_size": 40, "task_args": {"max_digits": 1}}],
        "apply_chat_template": True, "max_prompt_length": 64}
JOBS = {"sft": {"model": {"preset": "tiny"}, "trainer": {"num_steps": 2, "micro_batch_tokens": 2048}, "data": DATA,
                "sft": {"batch_size": 4, "eval_every": 0, "eval_prompts": 4}},
        "indexer-warmup": {"model": {"path": str(ASSET)},
                           "data": {**DATA, "tasks": [{"kind": "arithmetic", "eval_size": 8}]},
                           "indexer_warmup": {"corpus": "tasks", "seq_len": 64, "index_topk": 16, "batch_size": 2,
                                              "num_steps": 2, "eval_sequences": 2, "eval_every": 0}}}


def _job(command: str, tmp_path: Path, out: Path) -> list[str]:
    """`slime-dsa COMMAND recipe.yaml` for JOBS[command], writing its model to `out` and its run to tmp_path/run."""
    section = command.replace("-", "_")
    recipe = {**JOBS[command], "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"}}
    recipe[section] = {**recipe[section], "output_dir": str(out)}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return ["-m", "slime_dsa.cli", command, str(tmp_path / "recipe.yaml")]


@pytest.mark.parametrize("command", list(JOBS))
def test_an_unwritable_output_dir_is_refused_before_the_job_runs(tmp_path, command):
    """sft.output_dir (indexer_warmup.output_dir) under a directory that cannot be written: refused in one line
    naming the key and the path before the model loads. Before, the job trained to the end, then printed mkdtemp's
    PermissionError traceback (the trained model lost)."""
    out = _unwritable_directory(tmp_path) / "model"
    done = _run(_job(command, tmp_path, out), cwd=tmp_path)
    assert done.returncode == 2
    _one_line(done, f"{command.replace('-', '_')}.output_dir", str(out))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # a whole (two-step) job in a subprocess
@pytest.mark.parametrize("command", list(JOBS))
def test_a_full_disk_when_the_model_is_written_is_one_line(tmp_path, command):
    """The disk fills up while the trained model is written: one line naming the key and the path, nothing left
    beside it. Before, safetensors' SafetensorError traceback."""
    out = tmp_path / "out"
    done = _run(_job(command, tmp_path, out), wrap=("enospc", ".out.tmp-"), tmp_path=tmp_path, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line(done, f"{command.replace('-', '_')}.output_dir", str(out), "No space left on device", last=True)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.slow  # a whole (two-step) job in a subprocess
@pytest.mark.parametrize("command", list(JOBS))
def test_a_piped_job_prints_its_result_and_no_progress(tmp_path, command):
    """stdout and stderr are pipes: stdout is the one result line, stderr empty. Before, stdout began with a blank
    line (the step bar, a rich Progress on stdout, drawn once when not on a terminal) and stderr held the tokenizing
    bars of `datasets`, carriage returns and all."""
    out = tmp_path / "out"
    done = _run(_job(command, tmp_path, out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"model written: {out}\n"
    assert done.stderr == ""


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run `args` (as _run) with stdout and stderr on a pseudo-terminal; its exit code and everything it drew."""
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=follower,
                               stderr=follower)
    os.close(follower)
    drawn = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        try:
            chunk = os.read(leader, 65536) if ready else b""
        except OSError:  # the process closed its end
            chunk = b""
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    return process.wait(timeout=60), drawn.decode(errors="replace")


@pytest.mark.parametrize(("kind", "label"), [("export", "exporting"), ("to_megatron", "converting"),
                                             ("to_hf", "converting")])
def test_long_writes_draw_a_progress_bar_on_a_terminal_and_none_into_a_pipe(tmp_path, megatron_dir, kind, label):
    """On a terminal, export and the tools draw a bar of the weight files (the minutes of a large model); into a pipe,
    stderr holds no bar (no carriage return, no escape sequence). Before, they drew nothing on a terminal either."""
    code, drawn = _on_a_terminal(_commands(kind, tmp_path, megatron_dir, tmp_path / "on-terminal"))
    assert code == 0, drawn
    assert label in drawn, drawn
    done = _run(_commands(kind, tmp_path, megatron_dir, tmp_path / "piped"))
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\x1b" not in done.stderr and label not in done.stderr, done.stderr


def _run_dir_with_metrics(tmp_path: Path) -> Path:
    """A run directory whose metrics.jsonl holds two steps of reward, enough for `slime-dsa report` to plot."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "rollout/reward_mean": 0.5}}\n' for i in (1, 2)))
    return run


@pytest.mark.parametrize("where", ["unwritable", "under a file", "a file"])
def test_report_into_an_unwritable_out_is_one_line(tmp_path, where):
    """`slime-dsa report RUN --out DIR` where DIR cannot be made: one line naming it. Before, the PermissionError,
    NotADirectoryError or FileExistsError of its mkdir as a traceback."""
    run = _run_dir_with_metrics(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    out = {"unwritable": lambda: _unwritable_directory(tmp_path) / "report", "under a file": lambda: notes / "report",
           "a file": lambda: notes}[where]()
    done = _run(["-m", "slime_dsa.cli", "report", str(run), "--out", str(out)])
    assert done.returncode == 2
    line = _one_line(done, str(out))
    assert where == "unwritable" or f"{notes} is a file" in line
    assert notes.read_text() == "mine"


def test_a_first_plot_on_a_new_machine_adds_no_line_to_stderr(tmp_path):
    """`slime-dsa report` where matplotlib has no font cache yet (a fresh MPLCONFIGDIR): no matplotlib INFO line on
    stderr (its "generated new fontManager" once broke the one-line error tests on a new CI machine)."""
    run = _run_dir_with_metrics(tmp_path)
    done = _run(["-m", "slime_dsa.cli", "report", str(run), "--out", str(tmp_path / "out")],
                env={"MPLCONFIGDIR": str(tmp_path / "mpl")})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "reward.png").exists()
    assert "matplotlib" not in done.stderr, done.stderr
    assert list((tmp_path / "mpl").glob("fontlist-*.json")), "the font cache was not built: the test saw nothing"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _never(*args, **kwargs):
    raise AssertionError("the weights were read before the output was known to be writable")


@pytest.mark.parametrize("kind", KINDS)
def test_an_unwritable_output_is_refused_before_the_weights_are_read(tmp_path, megatron_dir, kind, monkeypatch,
                                                                      capsys):
    """Reading a large model's weights takes minutes; an output that cannot be created is refused before. Before,
    export loaded and checked the whole model, the tools read every shard, and only then failed."""
    from slime_dsa.checkpoint import hf_format
    from slime_dsa.cli import main

    out = _unwritable_directory(tmp_path) / "model"
    if kind == "export":
        monkeypatch.setattr(hf_format, "load_model", _never)
        code = main(["export", str(ASSET), "--out", str(out)])
    elif kind == "to_megatron":
        tool = _tool("convert_hf_to_megatron")
        monkeypatch.setattr(tool, "read_state_dict", _never)
        code = tool.main([str(ASSET), str(out)])
    else:
        tool = _tool("convert_megatron_to_hf")
        monkeypatch.setattr(tool, "load_file", _never)
        code = tool.main([str(megatron_dir), str(out)])
    assert code == 2
    assert str(out) in capsys.readouterr().err


def _truncated(source: Path, tmp_path: Path) -> Path:
    """A copy of `source` (a directory of model files) whose last .safetensors file is cut to 1000 bytes."""
    import shutil

    copy = tmp_path / "truncated"
    shutil.copytree(source, copy)
    weights = sorted(copy.rglob("*.safetensors"))[-1]
    weights.write_bytes(weights.read_bytes()[:1000])
    return copy


@pytest.mark.parametrize("kind", ["to_megatron", "to_hf"])
def test_a_truncated_source_weight_file_is_one_line_naming_it(tmp_path, megatron_dir, kind):
    """A source safetensors file cut short (a copy that died part way): one line naming the file. Before,
    safetensors' SafetensorError traceback (export already said it in one line)."""
    source = _truncated(ASSET if kind == "to_megatron" else megatron_dir, tmp_path)
    weights = sorted(source.rglob("*.safetensors"))[-1]
    args = _to_megatron(tmp_path / "out") if kind == "to_megatron" else _to_hf(source, tmp_path / "out")
    args[1] = str(source)
    done = _run(args)
    assert done.returncode == 2
    _one_line(done, str(weights), "not a readable safetensors file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--tensor-parallel", "--expert-parallel"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_parallel_size_below_one_is_a_usage_error(tmp_path, flag, value):
    """--expert-parallel 0 was a ZeroDivisionError traceback; -2 another."""
    done = _run([str(TOOLS / "convert_hf_to_megatron.py"), str(ASSET), str(tmp_path / "out"), flag, value])
    assert done.returncode == 2
    _one_line(done, flag, last=True)  # argparse's usage line, then its error line


def test_a_megatron_source_without_megatron_json_says_what_it_is_missing(tmp_path):
    """An HF directory given to convert_megatron_to_hf.py: one line saying it holds no megatron.json and which tool
    writes one. Before: "[Errno 2] No such file or directory: '.../megatron.json'"."""
    done = _run(_to_hf(ASSET, tmp_path / "out"))
    assert done.returncode == 2
    _one_line(done, str(ASSET), "megatron.json", "convert_hf_to_megatron.py")


def test_a_full_disk_when_the_run_builds_its_model_from_scratch_is_one_line(tmp_path):
    """A preset model (model.preset, no model.path) is saved into the run directory first (initial_model); a full disk
    there is one line naming it. Before, safetensors' SafetensorError traceback."""
    done = _run(_job("sft", tmp_path, tmp_path / "out"), wrap=("enospc", "initial_model"), tmp_path=tmp_path,
                cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line(done, str(tmp_path / "run" / "initial_model"), "No space left on device")
    assert not list((tmp_path / "run").glob(".initial_model*"))


def test_save_pretrained_counts_each_weight_file_of_a_sharded_model(tmp_path):
    """The bar of a multi-shard export moves once per weight file written, and its total is their number."""
    from slime_dsa.checkpoint import load_model, save_pretrained

    class Count:
        total = done = 0

        def add_total(self, count: int) -> None:
            self.total += count

        def advance(self, count: int) -> None:
            self.done += count

    count = Count()
    save_pretrained(load_model(ASSET), tmp_path / "out", max_shard_bytes=1 << 20, progress=count)
    files = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and count.total == count.done == len(files)
