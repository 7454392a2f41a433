r"""The engine's host work per cuda_ipc weight update, on CPU: the table parsed and the buffer's views built every
update (as before), against the server's last table and the engine's mapped buffer kept while the sender's handle
stays (rollout/server/app.py `_parse_cuda_ipc`, rollout/engine/async_engine.py `_open_ipc`); and with the kept
buffer, the finiteness check over the buffer's runs of one dtype (`float_spans`) against tensor by tensor.

Both sides run the same code in this process, alternating per round: the server's parse of the entry, then
AsyncEngine._load_cuda_ipc (name and shape checks, the views, Engine.update_weights: its checks, the copies and the
derived caches) on the small preset's 795 tensors; "each update" clears both caches first. The model has the
preset's structure (layers, experts, so the same tensors) at the tiny preset's widths, so the copies are cheap and
the host work shows.

    PYTHONPATH=$PWD python benchmarks/cuda_ipc_update_host_time.py --rounds 30

FAKE: CUDA IPC needs a GPU: the buffer is a host tensor that open_buffer hands out, so what is not counted here is
the GPU part, opening and closing the IPC mapping (cudaIpcOpenMemHandle / cudaIpcCloseMemHandle) once per update
before, once per sender after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_call_host_time import NARROW  # noqa: E402  (beside this script)

from rollout.engine import AsyncEngine, Engine  # noqa: E402
from rollout.server.app import _parse_cuda_ipc  # noqa: E402
from rollout.server.state import ServerState  # noqa: E402
from slime_dsa.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: E402
from slime_dsa.models.presets import preset_config  # noqa: E402
from slime_dsa.weights import cuda_ipc  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GlmMoeDsaForCausalLM(preset_config(args.preset, vocab_size=512, **NARROW)).eval()
    front = AsyncEngine(Engine(model, max_cache_tokens=256, block_size=16))  # its thread not started: called here
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    tensors, nbytes = cuda_ipc.layout([(n, tuple(t.shape), cuda_ipc.dtype_name(t.dtype)) for n, t in state.items()])
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    for name, view in cuda_ipc.views(flat, tensors).items():
        view.copy_(state[name])
    cuda_ipc.open_buffer = lambda buffer, device: flat  # FAKE (module docstring)
    buffer = cuda_ipc.IpcBuffer("GPU-1", b"\x01" * 64, nbytes, 0, nbytes, b"/torch_1_2_3", 0, None, False)
    wire = json.dumps(cuda_ipc.IpcWeights(buffer, tensors).to_json())
    server = ServerState(engine=front, tokenizer=None, api_key=None, max_body_bytes=1, max_weight_body_bytes=1,
                         max_prompt_tokens=None, model_path=None, served_model_name="m")

    def update(cached: bool, spans: bool = True) -> float:
        entry = json.loads(wire)  # each request's body is parsed anew (not timed: the same on both sides)
        if not cached:
            server.last_cuda_ipc, front._ipc = None, None
        elif front._ipc is not None:  # kept with its table: the spans as the engine built them, or none
            front._ipc.spans = cuda_ipc.float_spans(front._ipc.flat, front._ipc.tensors) if spans else None
        start = time.perf_counter()
        front._load_cuda_ipc(_parse_cuda_ipc(server, entry), None, flush_cache=True)
        return time.perf_counter() - start

    for cached in (False, True):  # warm-up, and the caches filled
        update(cached)
    times: dict[str, list[float]] = {"each update": [], "kept": [], "kept, checked by tensor": []}
    for _ in range(args.rounds):
        times["each update"].append(update(False))
        times["kept"].append(update(True))
        times["kept, checked by tensor"].append(update(True, spans=False))
    result = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    result["kept/each"] = result["kept"] / result["each update"]
    result["spans/by tensor"] = result["kept"] / result["kept, checked by tensor"]
    result["tensors"] = len(tensors)
    result["spans"] = len(cuda_ipc.float_spans(flat, tensors))
    print(f"{len(tensors)} tensors ({result['spans']} spans), median of {args.rounds} rounds: each update "
          f"{result['each update']:.2f} ms, kept {result['kept']:.2f} ms (ratio {result['kept/each']:.2f}), kept and "
          f"checked by tensor {result['kept, checked by tensor']:.2f} ms (spans / by tensor "
          f"{result['spans/by tensor']:.2f})")
    return result


if __name__ == "__main__":
    main()
