"""True on-policy through slime_dsa.ops.triton_invariant's kernels, run by Triton's CPU interpreter.

Run as `TRITON_INTERPRET=1 python -m tests.true_on_policy_interpret` (tests/test_true_on_policy.py does): the
invariant module sends CPU tensors to the Triton kernels here (on a GPU it does so for CUDA tensors), and the engine's
log-probs must equal the model's packed forward bit for bit in float32 at engine batch 1 and 3.
"""

from __future__ import annotations

import sys

import torch

from slime_dsa.checkpoint import build_model
from slime_dsa.models import PackedBatch
from slime_dsa.models.presets import preset_config
from slime_dsa.ops import invariant, triton_invariant
from tests.interpret_dot import use_row_invariant_dot
from tests.test_true_on_policy import VOCAB, prompts, rollout


def main() -> int:
    torch.set_num_threads(1)
    use_row_invariant_dot()
    invariant._gpu = lambda x: triton_invariant  # the kernels for every tensor, CPU ones included
    model = build_model(preset_config("tiny", VOCAB), seed=0).eval()
    with invariant.enabled(True):
        for batch, count in ((1, 2), (3, 3)):  # the interpreter is slow: few prompts, and batch 1 on two, one at a time
            samples = rollout(model, prompts(count, seed=batch), 0.8, batch, False)[::-1]
            ids = torch.tensor([t for s in samples for t in s.tokens])
            packed = PackedBatch.from_seqlens([s.total_length for s in samples])
            with torch.no_grad():
                logp, _ = model.token_logprobs(ids, packed, temperature=0.8)
            for s, start in zip(samples, packed.cu_seqlens_q[:-1].tolist()):
                trainer = logp[start + len(s.prompt_ids) : start + s.total_length]
                if not torch.equal(trainer, torch.tensor(s.rollout_logprobs)):
                    print(f"batch {batch}: sample {s.index} differs by {float((trainer - torch.tensor(s.rollout_logprobs)).abs().max())}")
                    return 1
    print("engine and trainer log-probs equal through triton_invariant (interpreter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
