"""The `slime-dsa` command line: recipe explain/check, one-line errors with exit code 2, a light `--help`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import slime_dsa
from slime_dsa.cli import main
from slime_dsa.config.introspect import sections

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "recipes" / "base.yaml")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m slime_dsa.cli ARGS` in a fresh interpreter, from the repository root."""
    return subprocess.run([sys.executable, "-m", "slime_dsa.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def one_line_error(capsys, *argv: str) -> str:
    """Run main(argv) expecting a user error: exit code 2, nothing on stdout, one line on stderr."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_recipe_check_ok(capsys):
    assert main(["recipe", "check", BASE]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == f"ok: {BASE}"
    assert len(lines) == 3 and lines[1].startswith("train: grpo on a random tiny model | tasks: arithmetic×1")
    assert lines[2] == ("rollout.max_concurrency: 256 samples in flight (null: one step: 4 prompts × 8 samples, at "
                        "least 256 per engine; synchronous loop)")


def test_recipe_check_resolves_max_concurrency_to_cover_the_step(capsys):
    step = ["--set", "rollout.prompts_per_step=64", "--set", "rollout.n_samples_per_prompt=16"]
    assert main(["recipe", "check", BASE, *step]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("rollout.max_concurrency: 1024 samples in flight")
    assert main(["recipe", "check", BASE, *step, "--set", "algorithm.name=async_reinforce"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith(
        "rollout.max_concurrency: 3072 samples in flight (null: (max_staleness + 1 = 3) steps × 64 prompts × 16")
    # the old default: one line says what it costs (a warning, not a refusal: a server may need the cap)
    assert main(["recipe", "check", BASE, *step, "--set", "rollout.max_concurrency=1000"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == (
        "rollout.max_concurrency (1000) is below one step's 1024 samples: 24 wait for a free place and the step "
        "waits on their tail; null covers the step")


def test_recipe_check_print_and_set(capsys):
    assert main(["recipe", "check", BASE, "--set", "rollout.temperature=0.25", "--print"]) == 0
    out, _ = capsys.readouterr()
    resolved = yaml.safe_load(out.split("\n", 3)[3])
    assert resolved["rollout"]["temperature"] == 0.25


def test_misspelled_key(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temprature: 0.7\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert err.startswith("slime-dsa: error: ") and err.endswith(
        "r.yaml:2: rollout.temprature: unknown key, did you mean rollout.temperature?")


def test_wrong_type_from_the_command_line(capsys):
    err = one_line_error(capsys, "recipe", "check", BASE, "--set", "rollout.temperature=hot")
    assert err == ("slime-dsa: error: command line (--set rollout.temperature=hot): rollout.temperature: "
                   "expected a number, got 'hot'")


def test_missing_defaults_file(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults: nowhere.yaml\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert "r.yaml:1: defaults: recipe file " in err and err.endswith("nowhere.yaml not found")


def test_a_weight_sync_that_is_not_built_is_refused_in_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  sglang:\n    weight_sync: tensor\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert err.endswith("r.yaml:3: rollout.sglang.weight_sync 'tensor' is not available yet; use auto, distributed "
                        "or disk")


def test_the_deepspeed_backend_without_deepspeed_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util  # noqa: PLC0415

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  backend: deepspeed\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert err.endswith("trainer.backend: 'deepspeed' needs DeepSpeed, which is not installed here "
                        "(pip install -e '.[deepspeed]')")


def test_the_megatron_backend_without_megatron_core_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util  # noqa: PLC0415

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else find_spec(name, *a))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  backend: megatron\n")
    err = one_line_error(capsys, "recipe", "check", str(recipe))
    assert err.endswith("trainer.backend: 'megatron' needs megatron-core, which is not installed here "
                        "(pip install -e '.[megatron]', on Python 3.12 or later: its only wheels)")


def test_errors_in_a_subprocess_are_one_line_without_traceback(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  num_steps: many\n")
    result = run_cli("recipe", "check", str(recipe))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.endswith("r.yaml:2: trainer.num_steps: expected an integer, got 'many'\n")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("argv", [["recipe", "check"], ["trian"], ["recipe", "frobnicate"], ["--log-level", "LOUD"]])
def test_usage_errors_are_one_line(capsys, argv):
    assert one_line_error(capsys, *argv).endswith("--help)")


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "recipe" in capsys.readouterr().out


def test_explain_lists_every_section(capsys):
    assert main(["recipe", "explain"]) == 0
    out = capsys.readouterr().out
    for name in sections():
        assert f"\n{name}: " in out, name


def test_explain_one_section_and_unknown_section(capsys):
    assert main(["recipe", "explain", "algorithm"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("algorithm: ") and "algorithm.icepop_alpha" in out and "\n  rollout." not in out
    err = one_line_error(capsys, "recipe", "explain", "algoritm")
    assert "unknown section 'algoritm'; did you mean algorithm?" in err


def test_explain_yaml_is_a_valid_recipe(capsys, tmp_path):
    assert main(["recipe", "explain", "--yaml"]) == 0
    recipe = tmp_path / "all.yaml"
    recipe.write_text(capsys.readouterr().out)
    assert main(["recipe", "check", str(recipe)]) == 0


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"slime-dsa {slime_dsa.__version__}"


def test_help_and_check_do_not_import_heavy_libraries():
    # each in a fresh interpreter: what a user's `slime-dsa --help` or `recipe check` would load
    probe = ("import sys; from slime_dsa.cli import main; code = main({argv!r}); "
             "heavy = sorted(m for m in ('torch', 'ray', 'transformers', 'datasets', 'wandb', 'aiohttp') if m in sys.modules); "
             "print('HEAVY', heavy); sys.exit(code)")
    with_model = ["recipe", "check", BASE, "--set", "model.path=recipes/assets/quickstart-sft"]  # its config.json read
    for argv in (["--help"], ["serve", "--help"], ["recipe", "check", BASE], with_model, ["recipe", "explain"]):
        result = subprocess.run([sys.executable, "-c", probe.format(argv=argv)], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "HEAVY []" in result.stdout, (argv, result.stdout[-200:])


def test_serve_and_generate_take_the_model_directory_as_model(capsys, tmp_path):
    for argv in (["serve"], ["serve", str(tmp_path)]):  # a bare directory is not taken
        assert one_line_error(capsys, *argv).endswith("the following arguments are required: --model (see slime-dsa serve --help)")
    err = one_line_error(capsys, "serve", "--model", str(tmp_path))
    assert err == f"slime-dsa: error: --model {tmp_path} has no config.json: not an HF-format model directory"
    for command in ("serve", "generate"):
        assert main([command, "--help"]) == 0
        assert "--model DIR" in capsys.readouterr().out


def test_module_entry_point():
    result = run_cli("--help")
    assert result.returncode == 0 and "recipe" in result.stdout


def _unbuilt_options() -> list[str]:
    """Every option promised but not built yet, as a --set override (read from the registries, so a built option
    drops out of this list the moment it is registered)."""
    from slime_dsa.algorithms.specs import PLANNED
    from slime_dsa.config.schema import PLANNED_TRAINER_BACKENDS

    return ([f"algorithm.name={name}" for name in PLANNED]
            + [f"trainer.backend={name}" for name in PLANNED_TRAINER_BACKENDS]
            + ["algorithm.kl_coef=0.1", "rollout.sglang.weight_sync=tensor"])


@pytest.mark.parametrize("override", _unbuilt_options())
def test_recipe_check_refuses_every_unbuilt_option_in_one_line(capsys, override):
    key = override.split("=")[0].rsplit(".", 1)[1]
    err = one_line_error(capsys, "recipe", "check", BASE, "--set", override)
    assert key in err and "not available yet" in err


@pytest.mark.parametrize("argv", [["--log-level", "INFO", "train", "r.yaml"], ["train", "r.yaml", "--log-level", "INFO"],
                                  ["recipe", "check", "r.yaml", "--log-level", "INFO"]])
def test_log_level_before_or_after_the_subcommand(argv):
    """The README's `--log-level INFO` may follow `slime-dsa train RECIPE` as well as precede the subcommand."""
    from slime_dsa.cli import build_parser

    assert build_parser().parse_args(argv).log_level == "INFO"
    assert build_parser().parse_args(["train", "r.yaml"]).log_level is None  # unset: the command's default level


def test_a_closed_pipe_ends_the_output_without_a_traceback():
    """`slime-dsa recipe explain --yaml | head -1`: the reader leaves before the CLI writes."""
    proc = subprocess.Popen([sys.executable, "-m", "slime_dsa.cli", "recipe", "explain", "--yaml"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the CLI has imported anything: its first write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err, err.decode()


@pytest.mark.slow
def test_sigterm_stops_a_run_the_way_ctrl_c_does(tmp_path):
    """A scheduler's SIGTERM: one line and exit 130, the run directory's lock released cleanly (emptied), where the
    default action ended the process at once."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_dsa.cli", "sft", "recipes/quickstart_sft.yaml", "--set", "trainer.num_steps=100000",
         "--set", f"logging.run_dir={run_dir}", "--set", f"sft.output_dir={tmp_path / 'model'}",
         "--set", "logging.wandb_mode=disabled"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    deadline = time.monotonic() + 240
    while not (run_dir / "sft.log").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1].startswith("slime-dsa: interrupted")
    assert (run_dir / ".lock").read_text() == ""  # a clean release empties the lock file


def _run_module(directory: Path, name: str) -> subprocess.CompletedProcess:
    """`python -m name` of a script written into `directory`, importing slime_dsa from this checkout."""
    env = {**os.environ, "PYTHONPATH": f"{directory}:{Path(__file__).parent.parent}"}
    return subprocess.run([sys.executable, "-m", name], env=env, capture_output=True, timeout=60)


def test_sigterm_inside_a_string_exec_still_exits_130(tmp_path):
    """CPython marks a plain KeyboardInterrupt leaving a string `exec` as unhandled and a `python -m` process then dies
    by SIGINT (-2) whatever main returned; SIGTERM's Terminated is a subclass, so the exit stays 130."""
    (tmp_path / "sigterm_in_exec.py").write_text(
        "import sys\n"
        "from slime_dsa.cli import _raise_on_sigterm\n"
        "_raise_on_sigterm()\n"
        "try:\n"
        "    exec('import os, signal, time\\nos.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(5)')\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n")
    proc = _run_module(tmp_path, "sigterm_in_exec")
    assert proc.returncode == 130, proc.stderr.decode()[-2000:]


def test_a_sigterm_that_lands_in_a_task_stops_the_run_with_nothing_printed_after_its_line(tmp_path):
    """A SIGTERM whose handler runs inside one of the run's asyncio tasks cancels the main task (as Ctrl-C does in
    asyncio.run), where a raise there left that task's exception unretrieved: asyncio printed "Task exception was
    never retrieved" and a traceback after the command's last line."""
    (tmp_path / "sigterm_in_task.py").write_text(
        "import asyncio, gc, logging, os, signal, sys\n"
        "from slime_dsa import interrupts\n"
        "from slime_dsa.cli import _raise_on_sigterm\n"
        "logging.basicConfig()\n"
        "async def rollout():\n"
        "    await asyncio.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in this task\n"
        "    await asyncio.sleep(5)\n"
        "async def main():\n"
        "    task = asyncio.ensure_future(rollout())\n"
        "    try:\n"
        "        await asyncio.sleep(5)\n"
        "    finally:\n"
        "        print('cleanup ran', file=sys.stderr)\n"
        "_raise_on_sigterm()\n"
        "try:\n"
        "    interrupts.run(main())\n"
        "except KeyboardInterrupt as e:\n"
        "    print(f'interrupted {type(e).__name__}', file=sys.stderr)\n"
        "gc.collect()\n")
    proc = _run_module(tmp_path, "sigterm_in_task")
    assert proc.stderr.decode().splitlines() == ["cleanup ran", "interrupted Terminated"], proc.stderr.decode()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one, on purpose
def test_a_sigterm_whose_exception_a_finalizer_swallowed_still_stops_the_next_step():
    """Python drops an exception raised in a signal handler that runs inside a finalizer; the run loops' per-step
    check (slime_dsa.interrupts) stops them anyway."""
    import gc
    import signal

    from slime_dsa import interrupts
    from slime_dsa.cli import _raise_on_sigterm

    class Finalized:
        def __del__(self):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # as if the signal landed here

    previous = _raise_on_sigterm()
    try:
        Finalized()  # its exception is printed as ignored, not raised here
        gc.collect()
        with pytest.raises(interrupts.Terminated):
            interrupts.raise_if_terminated()
    finally:
        interrupts.reset()
        signal.signal(signal.SIGTERM, previous)
    interrupts.raise_if_terminated()  # reset: nothing pending


def test_ray_init_keeps_the_clis_sigterm_handler(monkeypatch):
    """ray.init replaces the driver's SIGTERM handler (and Ray's core worker then aborts the driver with a C stack
    dump, exit 134); init_ray puts the CLI's back, so that `train` stops on SIGTERM the way Ctrl-C stops it."""
    import signal
    import types

    from slime_dsa import interrupts
    from slime_dsa.cli import _raise_on_sigterm
    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.cluster import init_ray

    def fake_init(**kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init does

    fake_ray = types.SimpleNamespace(is_initialized=lambda: False, init=fake_init)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    previous = _raise_on_sigterm()
    try:
        init_ray(load_recipe(BASE, []))
        assert signal.getsignal(signal.SIGTERM) is interrupts.terminate
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_sigterm_stops_an_rl_run_the_way_ctrl_c_does(tmp_path):
    """`train` starts Ray, whose init took SIGTERM over: one line and exit 130, as for sft, not Ray's abort."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slime_dsa.cli", "train", "recipes/quickstart.yaml", "--set", f"logging.run_dir={run_dir}",
         "--set", "logging.wandb_mode=disabled", "--set", "logging.eval_every=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    metrics = run_dir / "metrics.jsonl"  # created before step 1; its first line is step 1's
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1].startswith("slime-dsa: interrupted")
    assert sum("interrupted" in line for line in err.decode().splitlines()) == 1  # said once; train.log keeps it too
    assert "interrupted during step" in (run_dir / "train.log").read_text()
    assert (run_dir / ".lock").read_text() == ""


@pytest.mark.parametrize("reward_fn", ["math_verfy", "no_such_module:reward"])
def test_a_reward_fn_that_does_not_resolve_is_one_line_before_ray_starts(tmp_path, capsys, monkeypatch, reward_fn):
    """A misspelt reward_fn was a RewardLoadError traceback once Ray, the engines and the trainers had started."""
    from slime_dsa.orchestrator import cluster

    def no_ray(recipe):
        raise AssertionError("Ray started before the reward function was resolved")

    monkeypatch.setattr(cluster, "init_ray", no_ray)
    err = one_line_error(capsys, "train", BASE, "--set", f"data.tasks.0.reward_fn={reward_fn}",
                         "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "logging.wandb_mode=disabled")
    assert err.startswith("slime-dsa: error: data.tasks.0.reward_fn: ") and reward_fn in err, err


def test_wandb_online_without_a_key_is_one_line_before_ray_starts(tmp_path):
    """logging.wandb_mode online with no key: W&B was checked only once Ray, the engines and the trainer ranks had
    started (~100 s on two cores); now the line comes first, and nothing of Ray's or the engines' starts."""
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RAY_"))}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"), NETRC=str(tmp_path / "netrc"))
    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "slime_dsa.cli", "train", BASE, "--set", f"logging.run_dir={run_dir}",
                           "--set", "logging.wandb_mode=online"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("slime-dsa: error: logging.wandb_mode online: W&B did not start"), done.stderr[-2000:]
    assert "Ray instance" not in done.stderr and not list(run_dir.glob("engine_*.log")), done.stderr[-2000:]
    assert took < 60, took


def test_generate_from_a_directory_that_is_no_model_is_one_line(capsys, tmp_path):
    """`generate --model DIR` without config.json (or not there) was a FileNotFoundError traceback; serve's line."""
    for model in (tmp_path, tmp_path / "missing"):
        err = one_line_error(capsys, "generate", "--model", str(model), "--prompt", "hi")
        assert err == f"slime-dsa: error: --model {model} has no config.json: not an HF-format model directory"


def test_generate_from_a_url_nothing_answers_at_is_one_line(capsys, monkeypatch):
    """`generate --url` of a server that is not up was an EngineUnavailableError traceback after the retries."""
    from rollout.client import EngineClient
    from trainers.process_group import free_port

    monkeypatch.setattr(EngineClient, "__init__", _fast_client_init(EngineClient.__init__))
    err = one_line_error(capsys, "generate", "--url", f"http://127.0.0.1:{free_port()}", "--prompt", "hi")
    assert err.startswith("slime-dsa: error: no engine answered: /generate failed"), err


def _fast_client_init(init):
    def fast(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.max_retries = 0  # one attempt: the test needs no back-off

    return fast


def test_a_fresh_run_where_an_earlier_run_left_checkpoints_is_refused(tmp_path, capsys, monkeypatch):
    """`train` without --resume in a run directory holding checkpoints mixed the runs: its own saves were pruned as
    older than the earlier run's (keep_last), a later --resume continued the earlier run, metrics.jsonl held both."""
    import slime_dsa.orchestrator.train as train

    def no_run(recipe, resume=False):
        raise AssertionError("the run started")

    monkeypatch.setattr(train, "run_training", no_run)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000004").mkdir(parents=True)
    err = one_line_error(capsys, "train", BASE, "--set", f"logging.run_dir={run_dir}")
    assert err == (f"slime-dsa: error: {run_dir / 'checkpoints'} holds an earlier run's checkpoints (newest "
                   "step_000004): continue that run with --resume, or give this one another logging.run_dir")
    with pytest.raises(AssertionError, match="the run started"):  # --resume goes on
        main(["train", BASE, "--resume", "--set", f"logging.run_dir={run_dir}"])


def test_sft_into_a_run_dir_holding_an_earlier_runs_metrics_is_refused(tmp_path, capsys, monkeypatch):
    """A second `sft` into a run directory appended its steps to the earlier run's metrics.jsonl (two step 1s in one
    file, one W&B run). sft has no --resume, so it is refused as `train` refuses an earlier run's checkpoints."""
    import slime_dsa.sft

    def no_training(recipe):
        raise AssertionError("training started")

    monkeypatch.setattr(slime_dsa.sft, "run_sft", no_training)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n')
    err = one_line_error(capsys, "sft", BASE, "--set", f"logging.run_dir={run_dir}")
    assert err == (f"slime-dsa: error: {run_dir / 'metrics.jsonl'} holds an earlier run's metrics: sft cannot continue "
                   "a run; give this one another logging.run_dir, or remove that run directory to start over")
    (run_dir / "metrics.jsonl").write_text("")  # a run stopped before its first record: nothing to mix
    with pytest.raises(AssertionError, match="training started"):
        main(["sft", BASE, "--set", f"logging.run_dir={run_dir}"])


def test_indexer_warmup_into_a_run_dir_holding_an_earlier_runs_metrics_is_refused(tmp_path, capsys, monkeypatch):
    """A second `indexer-warmup` into a run directory appended its steps to the earlier run's metrics.jsonl (steps 1-6
    then 0, 1 in one file) and wrote over its model; it has no --resume, so it is refused as sft is."""
    import slime_dsa.indexer.warmup

    def no_training(recipe):
        raise AssertionError("training started")

    monkeypatch.setattr(slime_dsa.indexer.warmup, "run_indexer_warmup", no_training)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "indexer_warmup/indexer_kl": 0.1}\n')
    err = one_line_error(capsys, "indexer-warmup", BASE, "--set", f"logging.run_dir={run_dir}")
    assert err == (f"slime-dsa: error: {run_dir / 'metrics.jsonl'} holds an earlier run's metrics: indexer-warmup "
                   "cannot continue a run; give this one another logging.run_dir, or remove that run directory to "
                   "start over")
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(AssertionError, match="training started"):
        main(["indexer-warmup", BASE, "--set", f"logging.run_dir={run_dir}"])


def test_resume_without_a_checkpoint_says_so_on_the_console(tmp_path, caplog):
    """--resume that finds no checkpoint starts fresh; that was an INFO line in train.log only, so the console showed
    a run starting from step 0 without a word."""
    import logging

    from slime_dsa.config import load_recipe
    from slime_dsa.orchestrator.train import _checkpoints
    from slime_dsa.run_dir import open_run_dir

    recipe = load_recipe(BASE, [f"logging.run_dir={tmp_path / 'run'}", "logging.wandb_mode=disabled"])
    with caplog.at_level(logging.WARNING), open_run_dir(recipe, "train.log") as run_dir:
        _, resume_from = _checkpoints(recipe, run_dir, resume=True)
    assert resume_from is None
    assert any(r.levelno == logging.WARNING and "no checkpoint" in r.getMessage() for r in caplog.records)


def test_generate_to_an_output_it_cannot_open_is_one_line(capsys, tmp_path):
    """`generate --output DIR/that/is/not/there/out.jsonl` was a FileNotFoundError traceback after the model loaded."""
    out = tmp_path / "missing" / "out.jsonl"
    err = one_line_error(capsys, "generate", "--model", str(ROOT / "recipes" / "assets" / "quickstart-sft"),
                         "--prompt", "hi", "--max-new-tokens", "1", "--output", str(out))
    assert err == f"slime-dsa: error: --output {out}: No such file or directory"


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], "--port must be in 0..65535, got 99999"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1, got 0"),
    (["--max-cache-tokens", "-5"], "--max-cache-tokens must be >= 16, got -5"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1, got 0"),
    (["--dtype", "float8"], "--dtype must be one of"),
])
def test_serve_flags_out_of_range_are_one_line(capsys, flags, message):
    """`serve` with --port 99999 (OverflowError), --max-running-requests 0, --max-cache-tokens -5 or --dtype float8
    (ValueError from the engine after the model loaded) was a traceback."""
    model = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft"
    assert message in one_line_error(capsys, "serve", "--model", str(model), "--device", "cpu", *flags)


@pytest.mark.parametrize("target", ["--url", "--model"])
def test_generate_concurrency_below_one_is_one_line(capsys, target):
    """`generate --concurrency 0` was a ValueError traceback from the client (max_inflight_per_engine)."""
    where = "http://127.0.0.1:9" if target == "--url" else str(Path(__file__).resolve().parents[1] / "recipes" / "assets" / "quickstart-sft")
    assert one_line_error(capsys, "generate", target, where, "--prompt", "1+2=", "--concurrency", "0").endswith(
        "--concurrency must be >= 1, got 0")


@pytest.mark.parametrize("flags, env, source", [
    (["--api-key", ""], None, "--api-key"),
    (["--api-key", " "], "k", "--api-key"),
    ([], "", "$SLIME_DSA_API_KEY"),
])
def test_serve_refuses_an_empty_api_key(capsys, monkeypatch, flags, env, source):
    """`serve --api-key ""` (`--api-key "$KEY"` with KEY unset), or SLIME_DSA_API_KEY set empty, served everyone: the
    server takes an empty key for none."""
    import rollout.server.launch as launch

    def no_serving(*args, **kwargs):
        raise AssertionError("serving started")

    monkeypatch.setattr(launch, "serve", no_serving)
    if env is None:
        monkeypatch.delenv("SLIME_DSA_API_KEY", raising=False)
    else:
        monkeypatch.setenv("SLIME_DSA_API_KEY", env)
    model = str(ROOT / "recipes" / "assets" / "quickstart-sft")
    err = one_line_error(capsys, "serve", "--model", model, *flags)
    assert err == f"slime-dsa: error: {source} is empty: give the key clients must send, or unset it to serve without one"
    monkeypatch.setenv("SLIME_DSA_API_KEY", "from-env")
    served = {}
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: served.update(kwargs))
    assert main(["serve", "--model", model]) == 0 and served["api_key"] == "from-env"
    assert main(["serve", "--model", model, "--api-key", "flag"]) == 0 and served["api_key"] == "flag"


def test_generate_sends_the_key_from_the_environment(capsys, monkeypatch):
    """`generate --url` without --api-key sent no key, though `serve` reads SLIME_DSA_API_KEY: a server started with
    the key in the environment refused (401) a generate run from the same shell."""
    from tests.test_server import serving

    with serving(ROOT / "recipes" / "assets" / "quickstart-sft", api_key="the-key") as srv:
        argv = ["generate", "--url", srv.url, "--prompt", "1+2=", "--max-new-tokens", "1"]
        monkeypatch.delenv("SLIME_DSA_API_KEY", raising=False)
        assert "missing or wrong API key" in one_line_error(capsys, *argv)
        monkeypatch.setenv("SLIME_DSA_API_KEY", "the-key")
        assert main(argv) == 0
        assert len(capsys.readouterr().out.splitlines()) == 1
        assert "missing or wrong API key" in one_line_error(capsys, *argv, "--api-key", "wrong")  # the flag comes first
    main(["generate", "--help"])
    assert "SLIME_DSA_API_KEY" in capsys.readouterr().out


@pytest.mark.parametrize("device, message", [
    ("tpu", "--device must be cpu or cuda (cuda:N), got 'tpu'"),
    ("cuda", "--device cuda: torch sees no CUDA device on this machine; use --device cpu"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch, command, device, message):
    """`serve --device tpu` and `generate --model DIR --device cuda` on a CPU-only machine were a torch RuntimeError
    traceback once the model began to load."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = str(ROOT / "recipes" / "assets" / "quickstart-sft")
    argv = ["--model", model, "--device", device] + (["--prompt", "hi"] if command == "generate" else [])
    assert one_line_error(capsys, command, *argv) == f"slime-dsa: error: {message}"


@pytest.mark.parametrize("case, expected", [
    ("pickle", "holds no .safetensors weights"),
    ("shape", "tensor lm_head.weight has shape (3, 3)"),
    ("nan", "tensor lm_head.weight holds NaN or infinite values"),
])
def test_generate_checks_its_model_directory_as_serve_does(capsys, tmp_path, case, expected):
    """`generate --model DIR` loaded without serve's checks: no safetensors (a pytorch_model.bin) or a misshapen tensor
    was a FileNotFoundError or CheckpointError traceback, and NaN weights generated."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    source = ROOT / "recipes" / "assets" / "quickstart-sft"
    model = tmp_path / case
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("model.safetensors"))
    if case == "pickle":
        (model / "pytorch_model.bin").write_bytes(b"\x80\x02")
    else:
        weights = load_file(source / "model.safetensors")
        head = torch.zeros(3, 3) if case == "shape" else torch.full_like(weights["lm_head.weight"], float("nan"))
        save_file({**weights, "lm_head.weight": head}, model / "model.safetensors")
    err = one_line_error(capsys, "generate", "--model", str(model), "--prompt", "1+2=", "--device", "cpu")
    assert err.startswith(f"slime-dsa: error: {model}") and expected in err, err


def test_serve_names_a_preload_directory_that_holds_no_model(capsys, tmp_path):
    """`serve --preload-weights DIR` of a directory without weights was a FileNotFoundError traceback after the served
    model had loaded."""
    model = str(ROOT / "recipes" / "assets" / "quickstart-sft")
    err = one_line_error(capsys, "serve", "--model", model, "--device", "cpu", "--preload-weights", str(tmp_path))
    assert err.startswith(f"slime-dsa: error: --preload-weights: {tmp_path}"), err
