"""What a killed run leaves and what fails late (issue 21): a SIGKILLed run's /dev/shm weight directory is removed at
the next start (only when its pid is gone); `serve` on a busy port fails before loading the model, and `serve` and
`export` on bad weight files, in one line naming the file or tensor; a local Ray cluster runs on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from slime_dsa.cli import main
from slime_dsa.orchestrator.weight_sync.disk import SHM_PREFIX, remove_stale_shm_dirs, shm_dir_name

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_shm_weight_directories_of_gone_runs_are_removed(tmp_path):
    gone = tmp_path / f"{SHM_PREFIX}{_dead_pid()}-abcd1234"
    alive = tmp_path / f"{SHM_PREFIX}{os.getpid()}-abcd1234"
    legacy = tmp_path / f"{SHM_PREFIX}x8k2l1"  # an old run's name without a pid: not ours to judge
    for d in (gone, alive, legacy):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1024)
    assert remove_stale_shm_dirs(tmp_path) == [gone]
    assert not gone.exists() and alive.exists() and legacy.exists()
    assert shm_dir_name(tmp_path).name.startswith(f"{SHM_PREFIX}{os.getpid()}-")


@pytest.fixture
def model_dir(tmp_path, capsys) -> Path:
    from tests.hf_reference import make_hf_checkpoint

    directory = tmp_path / "model"
    make_hf_checkpoint(directory)
    capsys.readouterr()
    return directory


def _one_line(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip().removeprefix("slime-dsa: error: ")


def test_serve_on_a_busy_port_fails_before_loading_the_model(capsys, tmp_path, model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (model_dir / "model.safetensors").write_bytes(b"not even read")  # loading would fail: it must not be reached
        start = time.perf_counter()
        err = _one_line(capsys, "serve", "--model", str(model_dir), "--port", str(port))
    assert err == f"port {port} on 127.0.0.1 is in use (another server?); choose another with --port"
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_serve_on_a_host_this_machine_lacks_names_the_host(capsys, model_dir, host):
    """An address this machine does not have (TEST-NET-1) or a name that does not resolve said 'choose another with
    --port', when the port was never the problem."""
    (model_dir / "model.safetensors").write_bytes(b"not even read")  # loading would fail: it must not be reached
    err = _one_line(capsys, "serve", "--model", str(model_dir), "--host", host, "--port", "0", "--api-key", "k")
    assert err.startswith(f"--host {host} cannot be bound (") and err.endswith(
        "); give an address of this machine, or 0.0.0.0 for all of them"), err


def test_serve_and_export_on_bad_weight_files_are_one_line(capsys, tmp_path, model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = str(s.getsockname()[1])
    weights = model_dir / "model.safetensors"
    good = weights.read_bytes()
    state = load_file(weights)
    first, *rest = sorted(state)

    def attempts():  # (serve's line, export's line) for the weights as they are now
        serve = _one_line(capsys, "serve", "--model", str(model_dir), "--port", free)
        export = _one_line(capsys, "export", str(model_dir), "--out", str(tmp_path / "out"))
        return serve, export

    weights.write_bytes(good[:-100])  # truncated
    serve, export = attempts()
    assert serve.startswith(f"{weights} is not a readable safetensors file") and export.startswith(str(weights))
    save_file({k: state[k] for k in rest}, weights)  # a tensor missing
    serve, export = attempts()
    assert serve.startswith(f"{model_dir}: checkpoint is missing tensor {first}") and first in export
    bad = dict(state)
    bad[first] = bad[first].clone()
    bad[first].view(-1)[0] = float("nan")
    save_file(bad, weights)
    serve, export = attempts()
    assert serve == f"{model_dir}: tensor {first} holds NaN or infinite values; refusing to serve it"
    assert first in export and "NaN" in export
    (model_dir / "config.json").write_text('{"model_type": ')
    serve, export = attempts()
    assert serve.startswith(f"{model_dir / 'config.json'} is not valid JSON") and "config.json" in export
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_local_ray_cluster_takes_no_command_without_its_token(tmp_path):
    """Ray 2.60 listens on every interface and will not bind loopback; init_ray's cluster requires Ray's token, so a
    process without it (another user, another host) cannot join it, even at its non-loopback address."""
    code = textwrap.dedent(f"""
        import os, subprocess, sys, ray
        from slime_dsa.config import load_recipe
        from slime_dsa.orchestrator.cluster import init_ray
        init_ray(load_recipe(None, []))
        address = ray.get_runtime_context().gcs_address
        env = {{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}}
        env["HOME"] = {str(tmp_path / "stranger")!r}
        join = f"import ray; ray.init(address={{address!r}}); print('JOINED')"
        out = subprocess.run([sys.executable, "-c", join], capture_output=True, text=True, timeout=90, env=env)
        print("OUTSIDER", out.returncode, "JOINED" in out.stdout, "token" in out.stderr)
        ray.shutdown()
    """)
    (tmp_path / "stranger").mkdir()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OUTSIDER 1 False True" in out.stdout, out.stdout
