"""engine_throughput.py with the launch phase split on CPU: the decode batch's tensors, lm_head, sampling, uniforms,
finish codes, stop-id masks and top-k stores (device work on a GPU) are timed and printed as a sixth phase, `compute`;
launch minus compute is the launch's host work. Same arguments as engine_throughput.py.

    python benchmarks/engine_throughput_compute.py --device cpu --preset tiny --batch-sizes 1024 --hf-batch-sizes none \
        --paths rollout --new-tokens 64 --threads 1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput  # noqa: E402
from rollout.engine import decode, kv_cache, rows, sample_graph  # noqa: E402
from rollout.engine import engine as engine_module  # noqa: E402

_compute = [0.0]


def _timed(owner: object, name: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _compute[0] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def _instrument() -> None:
    for owner, name in ((decode.PagedDecoder, "_run"), (sample_graph, "sample"), (rows.SamplingRows, "uniforms"),
                        (rows.SamplingRows, "finish_codes"), (rows.SamplingRows, "mask_stop_ids"),
                        (kv_cache.PagedKVCache, "store_topk")):
        _timed(owner, name)
    init, step = engine_module.Engine.__init__, engine_module.Engine.step

    def instrumented_init(self, model, **kwargs):
        init(self, model, **kwargs)
        self.stats["compute_s"] = 0.0
        started = [0.0]
        model.lm_head.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
        model.lm_head.register_forward_hook(lambda *_: _compute.__setitem__(0, _compute[0] + time.perf_counter() - started[0]))

    def instrumented_step(self):
        outputs = step(self)
        self.stats["compute_s"] = _compute[0]  # cumulative over engines: the benchmark reads differences in one run
        return outputs

    engine_module.Engine.__init__, engine_module.Engine.step = instrumented_init, instrumented_step
    engine_throughput.HOST_PHASES = engine_throughput.HOST_PHASES + ("compute_s",)


if __name__ == "__main__":
    _instrument()
    engine_throughput.main(sys.argv[1:])
