"""The DeepSpeed backend (trainer.backend deepspeed): ZeRO 1/2/3 with optional host offload, behind the trainer seam.

config.py     trainer.deepspeed -> the JSON config deepspeed.initialize takes (clipping mapped from the recipe)
engine.py     one role's engine: the model partitioned (ZeRO-3 from the start), torch AdamW, entry through forward
gather.py     whole tensors out of ZeRO partitions, a bucket at a time (weights to engines, files, checkpoints)
checkpointing.py  pickle-free checkpoints (safetensors + JSON), the FSDP2 layout, resumable exactly
worker.py     the rank: the shared step's hooks (backward, apply_gradients) routed to the engine
group.py      the ranks as Ray actors
"""
