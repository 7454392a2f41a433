"""The orchestrator's side of rollout_call_host_time.py --paths http, in its own process as in the RL loop.

Reads one JSON line per run from stdin ({"url", "groups": [[prompt, [sampling_params, ...]], ...], "return_logprob",
"replay", "run", "form"}) and answers "ready"; on the next line ("go") sends one /generate call per group at once
through rollout.client.EngineClient, in the form the RL loop sends (form "n": one prompt with n and the first seed, as
to embedded engines; "batch": the same calls from a coalescing client, which sends them in one batch body, as the RL
loop does with rollout.coalesce_calls; "per-sample": one prompt per sample, as to SGLang), and prints two JSON lines:
{"wall_s": from the first call to the last response, "cpu_s": this process's CPU time meanwhile}, then
{"digest": digest(the response lists)}. No torch: the process stays small and starts fast.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time

from rollout.client import EngineClient


def digest(groups: list[list[dict]]) -> str:
    """sha256 of the responses, without the fields that change from run to run (rid, latency, cached_tokens)."""
    skip = {"id", "e2e_latency", "cached_tokens"}
    rows = [{**r, "meta_info": {k: v for k, v in r["meta_info"].items() if k not in skip}} for g in groups for r in g]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def group_call(client, prompt: list[int], params: list[dict], form: str, **options):
    """A group's call as rollout.groups.GroupRollout sends it: form "n" (and "batch", whose client merges the calls),
    the prompt once with n and the first seed (`params` differ only in consecutive seeds, as the RL loop's);
    "per-sample", one prompt per sample."""
    if form == "n" or form.startswith("batch"):
        return client.generate(prompt, {**params[0], "n": len(params)}, **options)
    return client.generate_batch([prompt] * len(params), params, **options)


def coalesce_option(form: str) -> bool | int:
    """EngineClient's coalesce for a form: "batch" True, "batch:N" at most N generations a body, else False."""
    return (int(form.split(":")[1]) if ":" in form else True) if form.startswith("batch") else False


async def run(spec: dict, client) -> dict:
    """One rollout of every group at once, gathered as the orchestrator gathers them (orchestrator/collection.py):
    its wall time, this process's CPU time and the responses. `client`: EngineClient or InProcessClient."""
    start, cpu = time.perf_counter(), time.process_time()
    groups = await asyncio.gather(*(
        group_call(client, prompt, params, spec.get("form", "per-sample"), return_logprob=spec["return_logprob"],
                   session_id=f"group-{spec['run']}-{g}", return_indexer_topk=spec["replay"], indexer_topk_start_len=0)
        for g, (prompt, params) in enumerate(spec["groups"])))
    return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "groups": groups}


async def main() -> None:
    client = None
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            spec = json.loads(line)
            client = client or EngineClient(spec["url"], max_inflight_per_engine=4096, timeout_s=3600,
                                            coalesce=coalesce_option(spec.get("form", "")))
            print("ready", flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # "go": the parent's timing starts
            done = await run(spec, client)
            print(json.dumps({"wall_s": done["wall_s"], "cpu_s": done["cpu_s"]}), flush=True)  # its timing ends
            print(json.dumps({"digest": digest(done["groups"])}), flush=True)
    finally:
        if client is not None:
            await client.close()


if __name__ == "__main__":
    asyncio.run(main())
