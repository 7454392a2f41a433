"""Dense indexer warm-up on CPU: does a re-initialised indexer recover recall, and does the IndexShare group-mean target
serve the shared layers better than the indexer's own layer alone?

1. Train a small GLM-MoE-DSA LM with dense attention on the built-in tasks' text (prompts + reference solutions), so
   that its attention carries something (a random model attends almost uniformly).
2. Re-initialise its indexers; measure recall of their top-k at 25% of the window and the LM loss with that top-k
   against the same model with dense attention.
3. Dense warm-up (indexers only) twice from the same start: target = group mean, target = own layer.
4. Report recall per group, recall averaged over the shared layers (the selection against each shared layer's own
   attention), KL and LM losses.

    python benchmarks/indexer_group_mean.py [--lm-steps 300] [--warmup-steps 150] [--out benchmarks/indexer_group_mean.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import platform
import time

import torch

from slime_dsa.checkpoint import build_model
from slime_dsa.config import RecipeConfig
from slime_dsa.data.prompts import build_tasks
from slime_dsa.data.tokenizer import EOS_TOKEN, build_tokenizer
from slime_dsa.indexer.evaluate import evaluate_indexers
from slime_dsa.indexer.warmup import held_out_documents, reinit_indexers, task_corpus, train_indexers, windows
from slime_dsa.models import ModelConfig, PackedBatch

logger = logging.getLogger("indexer_group_mean")

MODEL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=4, index_n_heads=4,
             index_head_dim=16, index_topk=16, indexer_types=["full", "shared", "shared", "shared"],
             max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def pretrain_dense(model, train, steps: int, batch_size: int, lr: float) -> list[float]:
    """Plain next-token training with dense attention (index_topk override = window length)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step in range(1, steps + 1):
        seqs = [next(train) for _ in range(batch_size)]
        ids, batch = torch.cat(seqs), PackedBatch.from_seqlens([len(s) for s in seqs])
        logp, _ = model.token_logprobs(ids, batch, index_topk=len(seqs[0]))
        keep = torch.ones_like(logp, dtype=torch.bool)
        keep[batch.cu_seqlens_q[:-1]] = False
        loss = -logp[keep].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0:
            logger.info("pretrain step %d: loss %.4f", step, sum(losses[-25:]) / 25)
    return losses


@torch.no_grad()
def recency_recall(model, sequences, topk: int) -> dict[str, float]:
    """Reference point: recall of the most recent `topk` keys (a sliding window), per group and over shared layers."""
    from slime_dsa.algorithms.indexer_loss import group_recall, indexshare_groups  # noqa: PLC0415

    ids = torch.cat(list(sequences))
    batch = PackedBatch.from_seqlens([len(s) for s in sequences])
    out = model.forward_packed(ids, batch, capture_dsa=True, return_logits=False, index_topk=len(sequences[0]))
    cols = batch.positions[:, None] - torch.arange(topk)[None, :]
    rows = torch.where(cols >= 0, cols + batch.key_start[:, None], -1)
    groups = indexshare_groups(model.config.indexer_types)
    rec = group_recall(out.dsa_layers, model.config.indexer_types, batch.cu_seqlens_q, batch.cu_seqlens_k,
                       {g: rows for g in groups}, per_layer=True)
    shared = [m for g, ms in groups.items() for m in ms if m != g]
    return {"recall": sum(float(rec[f"recall/{g}"].mean()) for g in groups) / len(groups),
            "recall_shared": sum(float(rec[f"recall_layer/{m}"].mean()) for m in shared) / max(len(shared), 1),
            "recall_layer/0": float(rec["recall_layer/0"].mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-sequences", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/indexer_group_mean.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tokenizer = build_tokenizer()
    config = ModelConfig(**MODEL, vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN))
    recipe = RecipeConfig.model_validate({"data": {"tasks": [
        {"kind": "arithmetic", "eval_size": 64, "task_args": {"max_digits": 3}},
        {"kind": "countdown", "eval_size": 64}],
        "apply_chat_template": True}})
    tasks = build_tasks(recipe.data, tokenizer)
    train = windows(task_corpus(recipe, tokenizer, seed=1, tasks=tasks), args.seq_len)
    # evaluated on the held-out prompts (a second draw from the training split before)
    eval_sequences = list(itertools.islice(windows(iter(held_out_documents(tasks, tokenizer)), args.seq_len),
                                           args.eval_sequences))
    topk = args.seq_len // 4

    start = time.perf_counter()
    model = build_model(config, seed=0)
    lm_losses = pretrain_dense(model, train, args.lm_steps, args.batch_size, lr=3e-3)
    pretrain_s = time.perf_counter() - start
    untrained = evaluate_indexers(model, eval_sequences, topk, args.seq_len)  # its build-time indexers, never trained
    reinit_indexers(model, seed=123)
    results = {"config": {"model": MODEL, "seq_len": args.seq_len, "index_topk": topk, "lm_steps": args.lm_steps,
                          "warmup_steps": args.warmup_steps, "batch_size": args.batch_size,
                          "eval_windows": args.eval_sequences, "warmup_lr": 1e-3},
               "pretrain": {"final_loss": sum(lm_losses[-25:]) / 25, "seconds": pretrain_s},
               "untrained_build_indexers": untrained, "recency_window": recency_recall(model, eval_sequences, topk)}
    for target in ("group", "own"):
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        res = train_indexers(m, train, eval_sequences, topk=topk, num_steps=args.warmup_steps,
                             batch_size=args.batch_size, learning_rate=1e-3, target=target)
        results[target] = {"before": res["before"], "after": res["after"], "seconds": time.perf_counter() - t0,
                           "topk_overlap_prev_step_last": res["history"][-1]["topk_overlap_prev_step"],
                           "kl_first_last": [res["history"][0]["indexer_kl"], res["history"][-1]["indexer_kl"]]}
    results["hardware"] = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    g, o = results["group"], results["own"]
    print(f"| | before (re-init) | after, group-mean target | after, own-layer target |")
    print(f"|---|---|---|---|")
    for key in ("recall", "recall_shared", "recall_layer/0", "indexer_kl", "lm_loss_sparse", "lm_loss_dense"):
        print(f"| {key} | {g['before'][key]:.4f} | {g['after'][key]:.4f} | {o['after'][key]:.4f} |")
    print("recency window of the same size:", {k: round(v, 4) for k, v in results["recency_window"].items()})


if __name__ == "__main__":
    main()
