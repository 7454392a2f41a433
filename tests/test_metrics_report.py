"""metrics.jsonl records carry wall-clock time; `slime-dsa report` draws each quantity on an axis of its own unit."""

from __future__ import annotations

import json
import math
import time

import pytest

from slime_dsa.logging.metrics import MetricsLogger, read_metrics
from slime_dsa.logging.report import plan_panels, render_report


def test_records_carry_time_and_elapsed_seconds_across_a_resume(tmp_path):
    before = time.time()
    log = MetricsLogger(tmp_path, "p", None, "disabled")
    log.log({"rollout/reward_mean": 0.5}, step=1)
    time.sleep(0.05)
    log.log({"rollout/reward_mean": 0.6}, step=2)
    log.close()
    first, second = read_metrics(tmp_path)
    assert round(before, 3) - 0.001 <= first["time"] <= second["time"] <= time.time() + 0.001  # ms resolution
    assert 0 <= first["elapsed_s"] < second["elapsed_s"] and second["elapsed_s"] >= 0.049
    resumed = MetricsLogger(tmp_path, "p", None, "disabled", resume_step=1)  # step 2 is dropped, time goes on
    resumed.log({"rollout/reward_mean": 0.7}, step=2)
    resumed.close()
    kept, again = read_metrics(tmp_path)
    assert kept == first and again["elapsed_s"] >= first["elapsed_s"] and again["time"] >= second["time"]


def _records(n: int = 12) -> list[dict]:
    start = 1_700_000_000.0
    return [{"step": s, "time": start + 30 * s, "elapsed_s": 30.0 * s,
             "rollout/reward_mean": s / n, "eval/reward_mean": s / n, "eval/pass@1": s / n,
             "train/loss": 1 / s, "train/pg_loss": 0.9 / s, "train/entropy": 2 - s / n, "train/pg_clipfrac": 0.01,
             "train/grad_norm": 1 + math.sin(s), "train/approx_kl": 1e-3 * s, "train/lr": 1e-6 * min(1, s / 4),
             "rollout/zero_std_groups": s % 3, "rollout/response_length_mean": 20 + s,
             "train/train_rollout_logprob_abs_diff": 1e-6, "perf/step_time_s": 30.0, "perf/rollout_time_s": 20.0}
            for s in range(1, n + 1)]


def test_a_resume_without_a_checkpoint_drops_the_killed_runs_records(tmp_path):
    """--resume that finds no valid checkpoint starts fresh, so the killed run's records (of steps it runs again) go;
    with a checkpoint only the records past it go; a new run appends."""
    from pathlib import Path  # noqa: PLC0415

    from slime_dsa.orchestrator.train import metrics_resume_step  # noqa: PLC0415

    log = MetricsLogger(tmp_path, "p", None, "disabled")
    for step in (0, 1, 2):
        log.log({"x": float(step)}, step=step)
    log.close()
    assert metrics_resume_step(resume=False, resume_from=None, start_step=0) is None
    assert metrics_resume_step(resume=True, resume_from=Path("ckpt/step_000001"), start_step=1) == 1
    fresh = MetricsLogger(tmp_path, "p", None, "disabled",
                          resume_step=metrics_resume_step(resume=True, resume_from=None, start_step=0))
    fresh.log({"x": 0.0}, step=0)
    fresh.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


def test_panels_have_units_and_keep_quantities_apart():
    panels = {p.filename: p for p in plan_panels(_records())}
    for p in panels.values():
        assert p.ylabel, p.filename
    together = lambda *keys: any(all(k in p.keys for k in keys) for p in panels.values())  # noqa: E731
    assert not together("eval/reward_mean", "eval/pass@1")
    assert not together("train/loss", "train/entropy")
    for key in ("train/grad_norm", "train/approx_kl", "train/lr", "rollout/zero_std_groups", "eval/pass@1"):
        assert any(key in p.keys for p in panels.values()), key
    wall = [p for p in panels.values() if p.x_key == "elapsed_s"]
    assert wall and "rollout/reward_mean" in wall[0].keys and "time" in wall[0].xlabel


def test_report_writes_the_panels_that_have_data(tmp_path):
    records = _records()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = {p.name for p in render_report(tmp_path)}
    assert {"reward.png", "pass_at_1.png", "entropy.png", "grad_norm.png", "kl.png", "learning_rate.png",
            "zero_std_groups.png", "reward_vs_time.png"} <= written
    old = [{k: v for k, v in r.items() if k not in ("time", "elapsed_s", "train/lr")} for r in records]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))  # a run from before
    written_old = {p.name for p in render_report(tmp_path, tmp_path / "old")}
    assert "reward_vs_time.png" not in written_old and "learning_rate.png" not in written_old
    assert "reward.png" in written_old


def test_per_domain_panels_draw_one_line_per_matching_key():
    from slime_dsa.logging.report import PANELS, panel_series

    records = [{"step": s, "opd/arithmetic/reverse_kl": 1.0 / s, "opd/sort/reverse_kl": 2.0 / s,
                "opd/sort/reward": 0.5, "eval/sort/pass@1": 0.1 * s} for s in (1, 2, 3)]
    panel = next(p for p in PANELS if p.filename == "reverse_kl_by_domain.png")
    series = panel_series(panel, records)
    assert sorted(series) == ["opd/arithmetic/reverse_kl", "opd/sort/reverse_kl"]
    assert series["opd/sort/reverse_kl"] == [(1, 2.0), (2, 1.0), (3, 2.0 / 3)]
    assert "pass_at_1_by_task.png" in {p.filename for p in plan_panels(records)}


def test_a_torn_last_line_is_skipped_by_resume_and_report(tmp_path, caplog):
    """A run killed while writing a record (or stopped by a full disk) leaves a torn last line in metrics.jsonl; a
    --resume then died with a JSONDecodeError traceback, and so did `slime-dsa report`. Both skip it with a warning."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    log = MetricsLogger(tmp_path, "p", None, "disabled")
    for step, record in enumerate(_records(3), 1):
        log.log(record, step=step)
    log.close()
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text()[:-40])  # step 3's record torn
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert "line 3 is not a JSON record" in caplog.text
    assert render_report(tmp_path)  # draws steps 1 and 2
    resumed = MetricsLogger(tmp_path, "p", None, "disabled", resume_step=2)
    resumed.log({"rollout/reward_mean": 0.7}, step=3)
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no records yet"):  # it printed nothing and exited 0
        render_report(tmp_path / "empty")


def test_wandb_online_without_a_key_is_one_user_error(tmp_path, monkeypatch):
    """logging.wandb_mode online with no WANDB_API_KEY and no `wandb login` was wandb's UsageError traceback (after
    Ray, the engines and the trainers had started)."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    with pytest.raises(UserError, match="logging.wandb_mode online: W&B did not start: .*logging.wandb_mode offline"):
        MetricsLogger(tmp_path / "run", "p", None, "online")


def test_async_dsa_and_indexer_warmup_runs_get_their_panels(tmp_path):
    """The asynchronous loop's staleness and IS band, the RL indexer loss and an indexer-warmup run's curves had no
    panel: `report` of a warm-up run wrote an empty directory, said nothing and exited 0."""
    import pytest  # noqa: PLC0415

    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    rl = [{"step": s, "async/staleness_mean": 1.5, "async/staleness_max": 2, "train/dis_frac_below": 0.05,
           "train/dis_frac_above": 0.0, "train/indexer_kl": 0.7 / s} for s in (1, 2)]
    assert {"staleness.png", "dis_frac.png", "indexer_kl.png"} <= {p.filename for p in plan_panels(rl)}
    warmup = [{"step": 0, "indexer_warmup/eval/recall": 0.6, "indexer_warmup/eval/indexer_kl": 2e-4},
              *({"step": s, "indexer_warmup/indexer_kl": 1e-4 / s} for s in (1, 2))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in warmup))
    assert {p.name for p in render_report(tmp_path)} == {"indexer_kl.png", "indexer_recall.png"}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text(json.dumps({"step": 1, "custom/x": 1.0}) + "\n")
    with pytest.raises(UserError, match="holds none of the keys the report draws"):
        render_report(tmp_path / "other")
    assert not (tmp_path / "other" / "report").exists()


def _wandb_file_records(path) -> list:
    """The protobuf records of an offline run's .wandb file (leveldb-log format: a 7-byte file header, 32 KiB
    blocks, a 7-byte header per chunk)."""
    import struct  # noqa: PLC0415

    from wandb.proto import wandb_internal_pb2 as pb  # noqa: PLC0415

    data, pos, chunks, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if size == 0 and kind == 0:
            break
        chunks, pos = chunks + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _offline_run(tmp_path, monkeypatch, resume_step: int | None, steps: tuple[int, ...]) -> tuple[str, list]:
    """Log `steps` to an offline W&B run of tmp_path; (its run id, the records of its .wandb file)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    log = MetricsLogger(tmp_path, "p", "n", "offline", resume_step=resume_step)
    for step in steps:
        log.log({"x": float(step)}, step=step)
    run_id, sync_file = log.wandb_run.id, log.wandb_run.settings.sync_file
    log.close()
    from pathlib import Path  # noqa: PLC0415

    return run_id, _wandb_records_when_written(Path(sync_file))


def _wandb_records_when_written(path) -> list:
    """The file's records once it holds the exit record (20 s at most): wandb's service process writes it on after
    finish() returns."""
    deadline = time.monotonic() + 20
    while True:
        records = _wandb_file_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


@pytest.mark.slow
def test_a_resumed_wandb_run_logs_only_the_steps_past_those_it_holds(tmp_path, monkeypatch):
    """--resume from step 1's checkpoint after steps 2-3 were logged: the same W&B run logged steps 2-3 a second time
    behind its step 3 (W&B's steps only increase); now the run keeps them and the resumed session logs from step 4,
    while metrics.jsonl is cut back to step 1 and holds the new 2-3."""
    pytest.importorskip("wandb")
    first_id, _ = _offline_run(tmp_path, monkeypatch, None, (1, 2, 3))
    run_id, records = _offline_run(tmp_path, monkeypatch, 1, (2, 3, 4))
    assert run_id == first_id
    steps = [json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "history"
             for i in r.history.item if (i.key or "/".join(i.nested_key)) == "_step"]
    assert steps == [4] and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_resume_continues_the_wandb_run_unless_it_kept_no_step():
    """The run's W&B id is kept; a resume that starts fresh (no step kept) is a new W&B run."""
    from slime_dsa.logging.metrics import wandb_run_id  # noqa: PLC0415

    assert wandb_run_id("abc", fresh=False) == "abc"
    assert wandb_run_id("abc", fresh=True) != "abc" and len(wandb_run_id(None, fresh=False)) == 12


def test_wandb_online_without_its_server_is_one_user_error(tmp_path, monkeypatch):
    """logging.wandb_mode online with a key but no network: wandb.init gave up after its init_timeout (~100 s) with a
    CommError traceback; now one line naming the key."""
    wandb = pytest.importorskip("wandb")
    from slime_dsa.config.errors import UserError  # noqa: PLC0415

    def unreachable(**kwargs):
        raise wandb.errors.CommError("Failed to get resume status for run x: context deadline exceeded\nwhile "
                                     "retrying: Post \"https://api.wandb.ai/graphql\": no such host")

    monkeypatch.setattr(wandb, "init", unreachable)
    with pytest.raises(UserError, match=r"logging.wandb_mode online: W&B's server did not answer: .*deadline exceeded; "
                                        r"while retrying.*logging.wandb_mode offline") as raised:
        MetricsLogger(tmp_path / "run", "p", None, "online")
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_a_run_stopped_by_an_exception_is_not_a_finished_wandb_run(tmp_path, monkeypatch):
    """Ctrl-C, SIGTERM or a crash closes the logger from a `finally`: W&B recorded exit code 0, so the run showed as
    finished; now 1 (failed), and a run that ends normally stays 0."""
    pytest.importorskip("wandb")
    _, finished = _offline_run(tmp_path / "ok", monkeypatch, None, (1,))
    assert [r.exit.exit_code for r in finished if r.WhichOneof("record_type") == "exit"] == [0]
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    log = MetricsLogger(tmp_path / "stopped", "p", "n", "offline")
    log.log({"x": 1.0}, step=1)
    sync_file = log.wandb_run.settings.sync_file
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            log.close()
    from pathlib import Path  # noqa: PLC0415

    assert [r.exit.exit_code for r in _wandb_records_when_written(Path(sync_file))
            if r.WhichOneof("record_type") == "exit"] == [1]
