"""Weight-update formats that trainers, the orchestrator and the engines agree on. Pure: no Ray, no HTTP.

  safetensors_b64.py  our safe body for /update_weights_from_tensor: base64 of safetensors bytes, in buckets
  cuda_ipc.py         a CUDA IPC buffer of weights described as a JSON table (engines on the trainer's GPU)
  payloads.py         the bodies of SGLang's other weight endpoints (disk, distributed, process group)

The transports that use them live in slime_dsa.orchestrator.weight_sync; the senders in trainers/ (with the
process group rank 0 joins for a broadcast, trainers/process_group.py).
"""


class WeightFormatError(ValueError):
    """A weight-update entry is malformed; the message names the field or tensor (servers answer 400)."""
