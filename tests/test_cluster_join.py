"""Joining a running Ray cluster (cluster.address): Ray's token, and one line for a cluster that cannot be joined."""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager

import pytest

from slime_dsa.config import load_recipe
from slime_dsa.config.errors import UserError
from slime_dsa.orchestrator import cluster


@pytest.fixture
def head():
    """host:port of something listening, as a head node's GCS port does."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _fake_ray(monkeypatch: pytest.MonkeyPatch, init) -> None:
    """ray.init is `init`; ray._raylet.Config.initialize counts in `mode` the RAY_AUTH_MODE it read again."""
    import os

    mode: list[str | None] = []
    config = types.SimpleNamespace(initialize=lambda system_config: mode.append(os.environ.get("RAY_AUTH_MODE")))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False, init=init, mode=mode))
    monkeypatch.setitem(sys.modules, "ray._raylet", types.SimpleNamespace(Config=config))


def _no_ray_auth_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(name, "")  # recorded, so that what init_ray sets is undone after the test
        monkeypatch.delenv(name)


def _refuse_without_token(address=None, **kwargs) -> None:
    """What ray.init does against a `ray start --head` cluster (token authentication) unless Ray's config was read
    again after RAY_AUTH_MODE=token (Ray reads it once, when imported)."""
    if sys.modules["ray"].mode[-1:] != ["token"]:
        try:
            raise RuntimeError("Failed to connect to GCS. ray.exceptions.AuthenticationError: RPC error: "
                               "InvalidAuthToken: Authentication token is missing or incorrect.")
        except RuntimeError as e:
            raise ConnectionError(f"Failed to connect to Ray cluster at {address}") from e


def test_joining_a_cluster_sends_the_users_ray_token(monkeypatch, tmp_path, head):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    monkeypatch.setenv("HOME", str(tmp_path))
    _no_ray_auth_env(monkeypatch)
    _fake_ray(monkeypatch, _refuse_without_token)
    cluster.init_ray(load_recipe(None, [f"cluster.address={head}"]))  # was: ConnectionError after ~20 s


def test_a_cluster_that_refuses_the_token_is_one_line(monkeypatch, tmp_path, head):
    monkeypatch.setenv("HOME", str(tmp_path))  # no token here
    _no_ray_auth_env(monkeypatch)
    _fake_ray(monkeypatch, _refuse_without_token)
    with pytest.raises(UserError, match=rf"cluster.address: cannot join the Ray cluster at '{head}': it refused "
                                        r"this driver's Ray token"):
        cluster.init_ray(load_recipe(None, [f"cluster.address={head}"]))


def test_a_cluster_that_cannot_be_joined_is_one_line(monkeypatch):
    def no_cluster(address=None, **kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    _fake_ray(monkeypatch, no_cluster)
    with pytest.raises(UserError, match=r"cluster.address: cannot join the Ray cluster at 'auto': Could not find any "
                                        r"running Ray instance. .*: check the address and that the cluster is up"):
        cluster.init_ray(load_recipe(None, ["cluster.address=auto"]))


def _cluster(monkeypatch: pytest.MonkeyPatch, *nodes: dict) -> None:
    ray = types.SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": r} for r in nodes])
    monkeypatch.setitem(sys.modules, "ray", ray)


QUICK = ["cluster.address=10.0.0.1:6379", "rollout.num_engines=2", "trainer.num_workers=2"]


def test_a_cluster_with_too_few_cpus_is_one_line(monkeypatch):
    _cluster(monkeypatch, {"CPU": 4.0})  # was: the run waited for ever, with no message at all
    with pytest.raises(UserError, match=r"cluster.num_cpus_per_actor: the run's 4 actors ask for 8 CPUs in all, but "
                                        r"the Ray cluster at 10.0.0.1:6379 has 4"):
        cluster.check_cluster_fits(load_recipe(None, [*QUICK, "cluster.num_cpus_per_actor=2"]))
    _cluster(monkeypatch, {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0})
    with pytest.raises(UserError, match=r"cluster.num_cpus_per_actor: each actor asks for 2 CPUs, but no node"):
        cluster.check_cluster_fits(load_recipe(None, [*QUICK, "cluster.num_cpus_per_actor=2"]))
    cluster.check_cluster_fits(load_recipe(None, QUICK))  # 4 actors of 1 CPU fit 4 nodes of 1


def test_a_cluster_with_too_few_gpus_names_the_gpu_key(monkeypatch):
    _cluster(monkeypatch, {"CPU": 16.0, "GPU": 1.0})
    with pytest.raises(UserError, match=r"cluster.num_gpus_per_engine: the run's 4 actors ask for 4 GPUs in all"):
        cluster.check_cluster_fits(load_recipe(None, [*QUICK, "cluster.num_gpus_per_engine=1",
                                                    "cluster.num_gpus_per_trainer=1"]))
    cluster.check_cluster_fits(load_recipe(None, [*QUICK, "cluster.num_gpus_per_engine=0.25",
                                                "cluster.num_gpus_per_trainer=0.25"]))


def test_an_address_where_nothing_listens_is_one_line_at_once(monkeypatch):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    _fake_ray(monkeypatch, lambda **kwargs: pytest.fail("ray.init retries an unreachable address for minutes"))
    start = time.monotonic()
    with pytest.raises(UserError, match=rf"cluster.address: nothing answers at 127.0.0.1:{port} "
                                        r"\(Connection refused\)"):
        cluster.init_ray(load_recipe(None, [f"cluster.address=127.0.0.1:{port}"]))
    assert time.monotonic() - start < 2


def test_engines_already_gone_at_shutdown_are_one_warning_each(monkeypatch, caplog):
    """The cluster died mid-run: stopping its engines logged a traceback each before the run's one line."""
    from slime_dsa.orchestrator.train import _shutdown

    class RayActorError(Exception):
        pass

    class ActorUnavailableError(RayActorError):
        pass

    def gone(ref, timeout=None):
        raise ActorUnavailableError("The actor is unavailable: failed to connect to all addresses")

    exceptions = types.SimpleNamespace(RayActorError=RayActorError)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get=gone, kill=lambda actor: None,
                                                                  exceptions=exceptions))
    monkeypatch.setitem(sys.modules, "ray.exceptions", exceptions)
    actor = types.SimpleNamespace(stop=types.SimpleNamespace(remote=lambda: None))
    _shutdown(types.SimpleNamespace(shutdown=lambda: None), [actor, actor])
    assert [r.exc_info for r in caplog.records] == [None, None]
    assert [r.getMessage() for r in caplog.records] == ["engine shutdown: an engine was already gone "
                                                        "(ActorUnavailableError)"] * 2


def test_a_live_rank_failing_because_its_peer_died_is_the_one_line_of_a_dead_rank(monkeypatch):
    """A trainer rank's node died in the asynchronous loop (2 ranks on 2 nodes): rank 0, alive, failed first in the
    weight push's gather (gloo: "Connection closed by peer"), and the run ended with that RayTaskError's traceback."""
    import asyncio

    import ray
    from ray.exceptions import ActorUnavailableError, RayTaskError

    from slime_dsa.orchestrator import train

    class Rank:  # FAKE trainer rank actor handle: __ray_ready__.remote() is the rank itself, which ray.get reads
        def __init__(self, alive: bool) -> None:
            self.alive = alive
            self.__ray_ready__ = types.SimpleNamespace(remote=lambda: self)

    def get(rank: Rank, timeout=None):
        if not rank.alive:
            raise ActorUnavailableError("The actor is unavailable: its node died", None)
        return None

    monkeypatch.setattr(ray, "get", get)
    peer_gone = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer")
    error = RayTaskError("full_state_dict", "Traceback (most recent call last): ...", peer_gone).as_instanceof_cause()
    ranks = [Rank(True), Rank(False)]
    run = types.SimpleNamespace(progress=types.SimpleNamespace(current=3), ckpts=types.SimpleNamespace(
        latest=lambda: "/c/step_000002"), trainers=types.SimpleNamespace(workers=ranks))
    assert asyncio.run(train._failure_line(run, error)) == (
        "a trainer rank died at step 3 (ActorUnavailableError); the newest checkpoint is /c/step_000002; --resume "
        "continues from it")
    ranks[1].alive = True
    assert asyncio.run(train._failure_line(run, error)) is None  # every rank answers: a bug, its traceback kept


def test_a_ray_client_address_without_ray_client_is_one_line(monkeypatch):
    def no_client(address=None, **kwargs):
        raise ValueError("Ray Client requires pip package `ray[client]`. If you installed the minimal Ray (e.g. "
                         "`pip install ray`), please reinstall by executing `pip install ray[client]`.")

    _fake_ray(monkeypatch, no_client)  # was: a ValueError traceback
    with pytest.raises(UserError, match=r"cluster.address: ray://10.0.0.1:10001 needs Ray Client, which this install "
                                        r"lacks: pip install 'ray\[client\]', or give the cluster's GCS address"):
        cluster.init_ray(load_recipe(None, ["cluster.address=ray://10.0.0.1:10001"]))


def _processes_using(directory: str) -> list[int]:
    """PIDs with a file open under `directory`: the processes of the cluster started there (never `ray stop`, which
    stops every Ray cluster of the user on this machine)."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory) for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


@contextmanager
def _ray_head(num_cpus: int, nodes: tuple[tuple[str, int], ...] = ()):
    """A real `ray start --head` cluster, started from its own temporary directory (its workers' working directory),
    without the driver's RAY_ variables; `nodes`: (address, CPUs) of more nodes joined with `ray start --address`
    (distinct loopback addresses: nodes of one machine that share its filesystem). Yields (port, env)."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths under it have at most 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    try:
        subprocess.run([ray_cli, "start", "--head", f"--port={port}", f"--temp-dir={temp}", f"--num-cpus={num_cpus}",
                        "--include-dashboard=false", "--disable-usage-stats"], env=env, check=True,
                       capture_output=True, timeout=120, cwd=temp)
        for address, cpus in nodes:  # a joining node asks for the head's token only when told to use one
            subprocess.run([ray_cli, "start", f"--address=127.0.0.1:{port}", f"--node-ip-address={address}",
                            f"--num-cpus={cpus}", "--disable-usage-stats"], env={**env, "RAY_AUTH_MODE": "token"},
                           check=True, capture_output=True, timeout=120, cwd=temp)
        yield port, env
    finally:
        for pid in _processes_using(temp):  # the joined nodes' too: they keep their files under the head's directory
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_driver_joins_a_ray_start_head_cluster_with_the_users_token():
    """`ray start --head` (token authentication by default) and a driver with RAY_AUTH_MODE unset: it joins."""
    import subprocess

    with _ray_head(num_cpus=1) as (port, env):
        code = ("import ray; from slime_dsa.config import load_recipe; from slime_dsa.orchestrator import cluster; "
                f"cluster.init_ray(load_recipe(None, ['cluster.address=127.0.0.1:{port}'])); "
                "print('CPUs', ray.cluster_resources()['CPU'])")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert "CPUs 1.0" in done.stdout, done.stderr[-2000:]  # was: ConnectionError (InvalidAuthToken) after ~20 s


@pytest.mark.slow
def test_a_run_on_a_joined_cluster_reads_its_relative_paths_from_the_drivers_directory(tmp_path):
    """The quickstart's model.path (recipes/assets/quickstart-sft, relative) on a cluster that `ray start` began in
    another directory: the trainer ranks looked for it there (FileNotFoundError traceback); paths are now absolute."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with _ray_head(num_cpus=4) as (port, env):
        sets = [f"cluster.address=127.0.0.1:{port}", f"logging.run_dir={tmp_path / 'run'}", "trainer.num_steps=2",
                "trainer.warmup_steps=0", "logging.wandb_mode=disabled", "logging.eval_every=0"]
        done = subprocess.run([sys.executable, "-m", "slime_dsa.cli", "train", "recipes/quickstart.yaml",
                               *(a for s in sets for a in ("--set", s))], env=env, cwd=root, capture_output=True,
                              text=True, timeout=400)
        assert done.returncode == 0, done.stderr[-2000:]


def test_relative_local_paths_become_absolute_and_hub_ids_stay():
    from pathlib import Path

    from slime_dsa.run_dir import with_absolute_paths

    recipe = with_absolute_paths(load_recipe(None, ["model.path=recipes/assets/quickstart-sft",
                                                    "model.tokenizer_path=org/some-tokenizer", "checkpoint.dir=ckpts"]))
    assert recipe.model.path == str(Path("recipes/assets/quickstart-sft").absolute())
    assert recipe.model.tokenizer_path == "org/some-tokenizer"  # not a local path: a Hub id
    assert recipe.checkpoint.dir == str(Path("ckpts").absolute()) and Path(recipe.logging.run_dir).is_absolute()


def test_actors_waiting_for_resources_other_jobs_hold_are_warned(monkeypatch, caplog):
    """Ray waited silently (a shared cluster whose CPUs another run held): one warning says how many and why."""
    actors = {"a": {"State": "ALIVE"}, "b": {"State": "PENDING_CREATION"}, "c": {"State": "PENDING_CREATION"}}
    ray = types.SimpleNamespace(
        get_runtime_context=lambda: types.SimpleNamespace(get_job_id=lambda: "01000000"),
        JobID=types.SimpleNamespace(from_hex=lambda job: job),
        _private=types.SimpleNamespace(state=types.SimpleNamespace(actors=lambda job_id: actors)),
        available_resources=lambda: {"CPU": 0.0})
    monkeypatch.setitem(sys.modules, "ray", ray)
    cluster.warn_unplaced(load_recipe(None, QUICK))
    assert [r.getMessage() for r in caplog.records] == [
        "2 of the run's actors wait for Ray to place them (1 CPU each, cluster.num_cpus_per_actor, and their GPUs): "
        "the cluster has 0 CPUs and 0 GPUs free now; other jobs hold the rest"]
    caplog.clear()
    actors.update(b={"State": "ALIVE"}, c={"State": "ALIVE"})
    cluster.warn_unplaced(load_recipe(None, QUICK))
    assert not caplog.records


@pytest.mark.slow
def test_a_run_across_ray_nodes_reaches_engines_and_ranks_on_other_nodes(tmp_path):
    """Two nodes at 127.0.0.2 and 127.0.0.3 joined to a head without CPUs (real Ray nodes of one machine; not NCCL
    between GPU nodes): the two engines and two trainer ranks land on them, one of each per node. Was refused in one
    line; engines listened on 127.0.0.1 of their node, and the ranks met at a port of the driver's node."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with _ray_head(num_cpus=0, nodes=(("127.0.0.2", 2), ("127.0.0.3", 2))) as (port, env):
        sets = [f"cluster.address=127.0.0.1:{port}", f"logging.run_dir={tmp_path / 'run'}", "trainer.num_steps=2",
                "trainer.warmup_steps=0", "logging.wandb_mode=disabled", "logging.eval_every=0",
                "trainer.num_workers=2", "rollout.num_engines=2"]
        done = subprocess.run([sys.executable, "-m", "slime_dsa.cli", "train", "recipes/quickstart.yaml",
                               *(a for s in sets for a in ("--set", s))], env=env, cwd=root, capture_output=True,
                              text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-2000:]
    log = (tmp_path / "run" / "train.log").read_text()
    up = next(line for line in log.splitlines() if "embedded engine(s) up" in line)
    assert "http://127.0.0.2:" in up and "http://127.0.0.3:" in up, up  # each at its node's address
    assert "weights v2 to 2 engine(s) by http" in log  # off trainer rank 0's node: http


def _fake_cluster_of_two(monkeypatch: pytest.MonkeyPatch, unseen: str, answers: bool = True) -> None:
    """FAKE Ray (one machine's nodes share its filesystem): the driver's node and 10.0.0.7, whose probe task does not
    see paths containing `unseen` (or, not `answers`, never finishes)."""
    nodes = [{"NodeID": "driver", "Alive": True, "Resources": {"CPU": 8.0}, "NodeManagerAddress": "10.0.0.1"},
             {"NodeID": "other", "Alive": True, "Resources": {"GPU": 8.0}, "NodeManagerAddress": "10.0.0.7"},
             {"NodeID": "empty", "Alive": True, "Resources": {"memory": 1e9}, "NodeManagerAddress": "10.0.0.8"}]

    def remote(**_):
        def wrap(probe):
            def run(paths):
                return probe(paths) + [p for p in paths if unseen in p]
            return types.SimpleNamespace(options=lambda **_: types.SimpleNamespace(remote=run))
        return wrap

    ray = types.SimpleNamespace(nodes=lambda: nodes, remote=remote, get=lambda refs: refs,
                                wait=lambda refs, num_returns, timeout: (refs, []) if answers else ([], refs),
                                get_runtime_context=lambda: types.SimpleNamespace(get_node_id=lambda: "driver"))
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies",
                        types.SimpleNamespace(NodeAffinitySchedulingStrategy=lambda node, soft: node))


def test_a_node_that_does_not_run_the_shared_paths_check_is_one_line(monkeypatch, tmp_path):
    """A node that never ran the probe task (down, or its raylet unreachable): ray.get's GetTimeoutError traceback
    after 120 s before; one line naming the node now, and the marker files are gone."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    _fake_cluster_of_two(monkeypatch, unseen="nothing", answers=False)
    with pytest.raises(UserError, match=r"cluster.address: node 10.0.0.7 of the Ray cluster did not run the check that "
                                        r"it sees the run's directories within 120 s \(of 1 such node\(s\)\)"):
        cluster.check_nodes_share_paths(load_recipe(None, QUICK), tmp_path / "model", tmp_path, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize("unseen, named", [("model", "model.path's"), ("run", "the run directory"),
                                           ("ckpts", "the checkpoint directory")])
def test_a_node_that_does_not_see_the_drivers_directories_is_one_line(monkeypatch, tmp_path, unseen, named):
    model, run, ckpts = tmp_path / "model", tmp_path / "run", tmp_path / "ckpts"
    for d in (model, run, ckpts):
        d.mkdir()
    (model / "config.json").write_text("{}")
    _fake_cluster_of_two(monkeypatch, unseen="nothing")
    cluster.check_nodes_share_paths(load_recipe(None, QUICK), model, run, ckpts)
    assert not list(run.iterdir()) and not list(ckpts.iterdir())  # the marker files are gone
    _fake_cluster_of_two(monkeypatch, unseen=f"/{unseen}/")
    with pytest.raises(UserError, match=rf"cluster.address: node 10.0.0.7 of the Ray cluster does not see {named} "
                                        rf".*{unseen}: a run across nodes needs the model, run and checkpoint "
                                        r"directories at the same paths on every node \(a shared filesystem\)"):
        cluster.check_nodes_share_paths(load_recipe(None, QUICK), model, run, ckpts)
    assert not list(run.iterdir())


@pytest.mark.parametrize("unseen, sets, named", [
    ("teacher", ["algorithm.name=opd", "teachers=[{name: t, path: TMP/teacher, domains: [arithmetic]}]"],
     "teacher 't''s path"),
    ("critic", ["algorithm.name=sao", "rollout.n_samples_per_prompt=1", "critic.path=TMP/critic"], "critic.path's")])
def test_a_node_that_does_not_see_a_teacher_or_the_critic_is_one_line(monkeypatch, tmp_path, unseen, sets, named):
    """Teacher engines and critic ranks load their models at the driver's paths too: a node that did not see them
    passed the check."""
    for d in ("model", "run", "ckpts", unseen):
        (tmp_path / d).mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / unseen / "config.json").write_text("{}")
    recipe = load_recipe(None, [*QUICK, *(s.replace("TMP", str(tmp_path)) for s in sets)])
    _fake_cluster_of_two(monkeypatch, unseen=f"/{unseen}/")
    with pytest.raises(UserError, match=rf"cluster.address: node 10.0.0.7 of the Ray cluster does not see {named} "
                                        rf"\S*/{unseen}: a run across nodes needs the model"):
        cluster.check_nodes_share_paths(recipe, tmp_path / "model", tmp_path / "run", tmp_path / "ckpts")


def test_engines_listen_on_their_node_address_on_a_joined_cluster():
    """A joined cluster may gain nodes while the run goes on (an autoscaler's): a replacement engine placed on one
    listened on that node's 127.0.0.1 when the run had started on the driver's node alone, out of the driver's reach."""
    assert cluster.engine_host(load_recipe(None, QUICK)) == "node"  # each engine's node address (NODE_ADDRESS)
    assert cluster.engine_host(load_recipe(None, [])) == "127.0.0.1"  # a local cluster: this machine


def _another_driver(port: int, env: dict, code: str) -> str:
    """The stdout of `code` run by another driver joined to the cluster at 127.0.0.1:port (`ray` imported, joined)."""
    import subprocess

    code = f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR')\n{code}"
    done = subprocess.run([sys.executable, "-c", code], env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _run_actors(port: int, env: dict) -> list[tuple[str, str]]:
    """(class, state) of every actor on the cluster at 127.0.0.1:port that is not dead, as another driver sees them."""
    import json

    out = _another_driver(port, env, "import json\nprint(json.dumps([(a['ActorClassName'], a['State']) for a in "
                                     "ray._private.state.actors().values() if a['State'] != 'DEAD']))")
    return [tuple(a) for a in json.loads(out.strip().splitlines()[-1])]


@pytest.mark.slow
def test_an_interrupt_while_actors_wait_for_a_busy_cluster_stops_at_once(tmp_path):
    """A joined cluster whose CPUs another job holds: the run's actors wait for Ray to place them. Ctrl-C or SIGTERM
    then hung (the start-up threads waited in ray.get for ever, and asyncio waited for them); now the run stops within
    seconds with one line naming what it waited for, exit 130, and leaves none of its actors on the cluster."""
    import signal
    import subprocess
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with _ray_head(num_cpus=2) as (port, env):
        _another_driver(port, env, "@ray.remote(num_cpus=2)\nclass OtherJob:\n    def ready(self): return 1\n"
                        "ray.get(OtherJob.options(name='other', lifetime='detached').remote().ready.remote())")
        for i, signum in enumerate((signal.SIGINT, signal.SIGTERM)):
            run_dir = tmp_path / f"run{i}"
            sets = [f"cluster.address=127.0.0.1:{port}", f"logging.run_dir={run_dir}", "rollout.num_engines=1",
                    "trainer.num_workers=1", "logging.wandb_mode=disabled", "logging.eval_every=0"]
            proc = subprocess.Popen([sys.executable, "-m", "slime_dsa.cli", "train", "recipes/base.yaml",
                                     *(a for s in sets for a in ("--set", s))], env=env, cwd=root,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 180
                while proc.poll() is None and time.monotonic() < deadline and not any(
                        state == "PENDING_CREATION" for _, state in _run_actors(port, env)):
                    time.sleep(1)
                assert proc.poll() is None, proc.stderr.read()[-2000:]
                time.sleep(2)
                proc.send_signal(signum)
                sent = time.monotonic()
                _, err = proc.communicate(timeout=60)
                took = time.monotonic() - sent
            finally:
                proc.kill()
            assert proc.returncode == 130, err[-2000:]
            last = err.strip().splitlines()[-1]
            assert last == ("slime-dsa: interrupted: while waiting for Ray to place 2 of the run's actors "
                            "(EngineActor, FSDPWorker; 1 CPU each, cluster.num_cpus_per_actor, and their GPUs): the "
                            "cluster has 0 CPUs and 0 GPUs free now; other jobs hold the rest"), err
            assert took < 15, took
            assert _run_actors(port, env) == [("OtherJob", "ALIVE")]


@pytest.mark.slow
def test_engines_and_rank_0_on_one_node_besides_the_drivers_get_weights_by_http(tmp_path):
    """A head without CPUs and one node that takes every actor: engines shared trainer rank 0's node, so auto chose
    shm, whose directory the driver makes (and reads back) in its own /dev/shm, which another machine's rank 0 and
    engines do not see (on one machine they do). Now http; shm asked for is one line."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with _ray_head(num_cpus=0, nodes=(("127.0.0.2", 4),)) as (port, env):
        def train(run: str, *more: str) -> subprocess.CompletedProcess:
            sets = [f"cluster.address=127.0.0.1:{port}", f"logging.run_dir={tmp_path / run}", "trainer.num_steps=1",
                    "trainer.warmup_steps=0", "logging.wandb_mode=disabled", "logging.eval_every=0", *more]
            return subprocess.run([sys.executable, "-m", "slime_dsa.cli", "train", "recipes/quickstart.yaml",
                                   *(a for s in sets for a in ("--set", s))], env=env, cwd=root, capture_output=True,
                                  text=True, timeout=300)

        done = train("auto")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "weight sync: http (rollout.weight_sync auto)" in (tmp_path / "auto" / "train.log").read_text()
        done = train("shm", "rollout.weight_sync=shm")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "slime-dsa: error: rollout.weight_sync 'shm' needs trainer rank 0 on this driver's Ray node (the driver makes "
        "its /dev/shm directory and reads the weights back there), and the Ray cluster placed it on another: use "
        "auto or http")


def test_a_replacement_engine_that_died_with_its_node_is_one_warning_line(caplog, monkeypatch):
    """The lost engine's node was the only one with room, and Ray, not yet aware that it had died, placed the
    replacement there: the warning carried Ray's message of four lines to the console."""
    import asyncio

    from slime_dsa.orchestrator import engines
    from slime_dsa.orchestrator.engines import EngineFleet

    class ActorDiedError(Exception):
        pass

    class Client:  # FAKE rollout.client.EngineClient: the calls the fleet makes
        staged: list[str] = []

        def on_engine_lost(self, callback) -> None:
            self.lost = callback

    def start_one():
        raise ActorDiedError("The actor died unexpectedly before finishing this task.\nThe actor died because its node "
                             "has died. Node Id: 4583d7\n\tthe actor's node was terminated unexpectedly: health check "
                             "failed due to missing too many heartbeats\nThe actor never ran - it was cancelled before "
                             "it started running.")

    # ray.kill on the FAKE actor would start a local Ray of this machine's cores in the test process, which the
    # session's ray_cluster fixture then reuses (a later run's actors waited for CPUs for ever)
    monkeypatch.setattr(engines, "_kill", lambda actor: None)

    async def lose_one() -> None:
        client = Client()
        fleet = EngineFleet(client, {"http://127.0.0.4:1": object()}, start_one)
        client.lost("http://127.0.0.4:1", "its process died")
        assert not await fleet.wait_for_restarts(timeout_s=10)

    asyncio.run(lose_one())
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "could not replace engine http://127.0.0.4:1: ActorDiedError: The actor died unexpectedly before finishing "
        "this task. The actor died because its node has died. Node Id: 4583d7 the actor's node was terminated "
        "unexpectedly: health check failed due to missing too many heartbeats The actor never ran - it was cancelled "
        "before it started running."]
