#!/bin/bash
# The one-GPU recipes on a bare GPU machine without the project's dependencies (this workplace's H200 device):
# install carried wheels, run stages, copy logs and metrics to $OUT. Run from the repo root with the wheels in $WHL
# (default .whl, git-ignored, carried to the device: cp312 manylinux wheels + ray as a .tar.xz, built here by
# benchmarks/device_wheels.sh; see
# benchmarks/RESULTS.md, "One-GPU recipes on an H200").
#   STAGES="setup kern20 kern20b table20 prof ptrain sft sftlong rl abours hostbench vstrl vstrlrel vstrllong rollhttp rollspy rlspy trlnan opd test ds engthr mgbench invk tonp steps" (any subset, run in the order given), SFT_STEPS SFT_EVAL SFT_TRAIN SFT_T,
#   RL_STEPS RL_TRAIN RL_T RL_SET (extra --set arguments) RL_RECIPE (default recipes/gpu_single.yaml; e.g.
#   recipes/gpu_single_async.yaml, the asynchronous loop with engine and trainer on the GPU at once), TEST_FILES TEST_T, PROF_T, VSTRL_ARGS VSTRL_NAME VSTRL_T;
#   *_T are wall-clock caps in seconds; NO_RAYLOGS=1 skips the closing Ray-log archive.
# ptrain (benchmarks/profile_train_step.py: one RL train call profiled at 100, 300 and 1000 tokens per sequence; PTRAIN_ARGS
# adds arguments, PTRAIN_T caps it, default 180 s) writes $OUT/profile_train.md and .json.
# opd (benchmarks/opd_swap_gpu.py: two teachers swapped from pinned memory into one engine, OPD_STEPS steps, OPD_T
# cap, OPD_ARGS extra arguments, e.g. "--cpu --preset tiny" for a CPU dry run) writes one file, $OUT/opd.log: the
# result table (swap time per teacher, teacher-scoring tok/s) and the run log's tail.
# vstrl (benchmarks/vs_trl.py --device cuda --task countdown, TRL GRPOTrainer vs ours on the SFT model) needs trl and
# accelerate wheels in whl/ too. VSTRL_ARGS replaces its default arguments (the full comparison on $W/sft/model);
# VSTRL_NAME names its log ($OUT/$VSTRL_NAME.log) and work directory, so a smoke run and the real one can share a call.
# It also writes $OUT/${VSTRL_NAME}_result.json, _ours_metrics.jsonl (ours' perf/rollout_* and perf/engine_* per step)
# and _engine_0.log; the nvidia_ml_py wheel in whl/ gives the report's GPU-busy column (else "-"). With --profile-steps
# in VSTRL_ARGS, each traced step's `python -m slime_dsa.logging.timeline` report ($OUT/${VSTRL_NAME}_timeline_step_N.md)
# and its traces (_traces_step_N.tgz).
# sftlong: SFT as the sft stage, of recipes/gpu_single_sft_long.yaml (countdown, 3 numbers, worked steps with the
# search's pairs listed: answers of ~280 tokens) into $W/sftlong/model; SFTLONG_STEPS (default 200), SFTLONG_TRAIN
# (30000), SFTLONG_T (480 s cap),
# SFT_EVAL, SFT_SET and SFT_FORCE as for sft; writes $OUT/sftlong.log and sftlong_metrics.jsonl.
# vstrlrel: the vstrl stage with --ours-kv-cache release (the engine frees its KV cache and decode graphs at every
# training call, as before cluster.engine_kv_cache_in_training): the A/B of keeping them (VSTRL_NAME default
# vstrl_release).
# vstrllong: the vstrl stage in the long-answer configuration, on $W/sftlong/model with its task_args, 16 x 16, 384 new
# tokens (VSTRL_NAME default vstrl_long, VSTRL_ARGS replaces the defaults; a JSON --task-args must hold no spaces).
# rollhttp (benchmarks/rollout_call_host_time.py --device cuda --model-forward real, 300m, batch 1024 = 64 x 16, no replay
# rows: the rollout path in process and over the embedded server's HTTP from a client process, as the RL loop calls it;
# ROLLHTTP_LENGTHS rl (default: answers end at varied steps, ~19 tokens) or fixed, ROLLHTTP_ARGS adds arguments,
# ROLLHTTP_T caps it, default 240 s) appends to $OUT/rollhttp.log and writes $OUT/rollhttp_<lengths>.json: whether the
# RL loop's 53-62% decode host gap at 64 x 16 comes from the shrinking batch (in process shows it too) or the server.
# rollspy: the rollhttp stage's in-process path (1024 samples, 300m, ROLLHTTP_LENGTHS) under py-spy (500 Hz, every
# thread, idle samples in; ROLLSPY_ARGS adds benchmark arguments, ROLLSPY_T caps it, default 180 s): $OUT/rollspy.md
# is benchmarks/spy_steps.py's report (samples inside Engine.step by frame), $OUT/rollspy.json the benchmark's figures.
# PY_SWITCH_INTERVAL: sys.setswitchinterval of every Python process (setup writes /tmp/site/sitecustomize.py).
# rlspy: the rl stage's loop (recipes/gpu_single.yaml, 64 x 16, on $W/sft/model when the sft stage made it, else the
# recipe's model), RLSPY_STEPS steps (default 30), with py-spy attached after step 1 to the engine actor and the trainer
# rank for RLSPY_D seconds (default 12; RLSPY_RATE Hz, default 250, --nonblocking: the processes are not paused):
# $OUT/rlspy.md (spy_steps.py --threads of the engine, --every-process of the trainer), rlspy.log, rlspy_metrics.jsonl.
# trlnan (benchmarks/trl_nan_check.py on $W/sftlong/model with LONG_TASK_ARGS: TRL's GRPO loss and backward on 4
# batches of 256 sampled completions, one cut to 30 tokens, zero advantages, per attention setting sdpa / sdpa-math /
# sdpa-eff / sdpa-cudnn / eager; names the backward function that first returns NaN; TRLNAN_ARGS adds arguments, e.g.
# "--rounds 8", TRLNAN_T caps it, default 420 s) writes $OUT/trlnan.log.
# mgbench (benchmarks/megatron_vs_fsdp.py: Megatron TP=1 against FSDP2 on a 1.1B GLM-MoE-DSA model; each backend in
# its own process: 5 short bf16 conformance steps, then train tokens/s and MFU, then one step under torch.profiler
# (FSDP2 and Megatron only: $OUT/megatron_vs_fsdp_profile.txt, top 25 ops by device and by CPU time each, and in the
# log the ops Megatron spends more on). FSDP2 and Megatron run first, so the throughput verdict lands before the
# optional parts: fsdp_split (the bf16 noise floor), fsdp_f32 (the float32 reference), then --layerwise
# (benchmarks/megatron_layerwise.py, where Megatron's bf16 forward first differs from FSDP2's). Every phase's figures
# reach the JSON when it ends, and the cap's SIGTERM keeps what finished) needs the megatron-core cp312 wheel in whl/;
# MGBENCH_ARGS adds arguments (e.g. "--backends fsdp,megatron,megatron_stock": the A/B of megatron's own optimizer
# fallbacks), MGBENCH_T caps it (default 400 s); writes $OUT/megatron_vs_fsdp.json, .log and _profile.txt.
# ds: DeepSpeed on GPU 0 (DS_GPU picks another): the bf16 conformance against FSDP2 (tests/test_deepspeed_gpu.py,
# DS_TEST_T caps it, default 120 s), then benchmarks/deepspeed_capacity.py (the largest model FSDP2 and ZeRO-3 + CPU
# offload train on this GPU, tokens/s of each; DSCAP_ARGS replaces its arguments, DSCAP_T caps it, default 210 s);
# everything in one file, $OUT/deepspeed.log. Needs the DeepSpeed wheels in whl/ (deepspeed, hjson, py-cpuinfo,
# ninja, einops, msgpack, psutil); installs them if a warm machine's setup ran without them.
# engthr (benchmarks/engine_throughput.py, preset 300m, bf16, 128 new tokens, as RESULTS.md's "Engine throughput:
# preset 300m" entries): the simple path and the rollout path (groups of 16: 16x16 and 64x16) at ENGTHR_BATCHES
# (default 256,1024), transformers `generate` at ENGTHR_HF (default 256) for the ratio, no eager (no-graph) rerun, the
# rollout path timed again after a KV-cache release (--release-kv: what a colocated RL step's hand-over costs);
# ENGTHR_ARGS adds arguments, ENGTHR_T caps it (default 150 s). Writes $OUT/engthr.log only (NO_RAYLOGS=1 skips the
# closing Ray-log archive too).
# kern20, kern20b: issue 20's newer kernels (first run on an H100 on 2026-12-05; the Gluon sparse MLA forward, plain and
# warp-specialised, and backward kernels, the sampled top-k select). kern20: their GPU tests, then
# benchmarks/sparse_mla_fwd_variants.py (idx_reg and every Gluon config): $OUT/kern20_pytest.log, kern20_fwd.json. kern20b: benchmarks/paged_indexer_variants.py, then
# benchmarks/sparse_mla_bwd_variants.py --modes split64 split64_gluon_dkv gluon_split gluon_fused: kern20_select.json,
# kern20_bwd.json.
# table20: issue 20's acceptance run (its kernels' GPU tests, then benchmarks/dsa_kernels.py at 32K-128K with the KL
# loss and decode rows, then the same with --no-gluon: the Triton kernels alone); see the stage for its caps.
# invk (benchmarks/invariant_kernels.py: the batch-invariant Triton kernels of issue 23 against cuBLAS / torch at the
# 300m preset's shapes, decode and training M; INVK_ARGS adds arguments, INVK_T caps it, default 420 s) writes
# $OUT/invk.md (the tables) and $OUT/invk.log.
# steps (benchmarks/step_overheads.py --device cuda, 16 x 16, 64 tokens, on $W/sft/model, else a random small preset):
# the synchronous step's phases and, between two rollouts, each engine request and trainer call per step; STEPS_ARGS
# adds arguments (e.g. "--baseline .stepbase --rounds 2": the same against an older tree), STEPS_T caps it (420 s).
# abours: ours alone (benchmarks/vs_trl_ours.py) from this tree and from the tree AB_BASE (default .stepbase, e.g.
# `git archive <rev> --prefix=.stepbase/ | tar -x` with recipes/assets, benchmarks/assets, tests and docs removed so
# that it travels), runs in the order AB_ORDER (default "new base base new"), each capped at AB_T seconds (110), with
# AB_ARGS (default 64 x 16 on the sft stage's model, 16 steps, prefetch on, step AB_PROFILED=14 profiled, GPU only);
# writes $OUT/ab_<side><n>.log, _metrics.jsonl, _result.json, _timeline.md and $OUT/ab.md (benchmarks/ab_ours.py: the
# runs' medians over their short steps).
# hostbench: the host-time benchmarks that run on the GPU, this tree against HB_BASE (default .stepbase):
# grad_bookkeeping_host_time.py (the bf16 copy's sums and clip), logprob_chunks_host_time.py (log-prob chunk widths)
# train_call_host_time.py (a whole train call, preset small) and copy_micro_batch_host_time.py (one micro-batch
# through the bf16 copy: its stacked expert leaves against the baseline's per-expert weights); HB_T caps each (default
# 240 s); writes $OUT/hostbench.log.
# tonp (benchmarks/true_on_policy.py on recipes/gpu_single.yaml from the sft stage's model: TONP_STEPS RL steps, default
# 20, with model.true_on_policy off then on; issue 23's step-time ratio and exact-match fraction; TONP_ARGS adds
# arguments, e.g. "--rounds 2", TONP_T caps it, default 420 s) writes $OUT/tonp.md (the table) and $OUT/tonp.log.
set -o pipefail
STAGES=${STAGES:-"setup test sft rl"}
W=/root/hg                      # survives between calls while the machine is warm (not under a carried path)
mkdir -p $W
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
CLI="python3 -m slime_dsa.cli"
vstrl_stage() {  # DEFAULT_NAME DEFAULT_ARGS: benchmarks/vs_trl.py on countdown; VSTRL_NAME and VSTRL_ARGS replace them
  local N=${VSTRL_NAME:-$1}
  stamp "vstrl ($N)"
  python3 -c "import pynvml" 2>/dev/null || echo "no pynvml: the GPU busy column reads '-' (nvidia_ml_py wheel missing from ${WHL:-.whl}, or setup skipped on a warm machine)"
  rm -rf $W/$N
  timeout -s INT -k 30 ${VSTRL_T:-540} python3 benchmarks/vs_trl.py --device cuda --task countdown ${VSTRL_ARGS:-$2} \
    --workdir $W/$N 2>&1 | tr "\r" "\n" | grep --line-buffered -v -e "━" -e "tokenizing" -e "Writing model shards" \
    | tee $OUT/$N.log | tail -40
  cp $W/$N/result.json $OUT/${N}_result.json 2>/dev/null
  cp $W/$N/ours/metrics.jsonl $OUT/${N}_ours_metrics.jsonl 2>/dev/null  # perf/rollout_*, perf/engine_* per step
  cp $W/$N/ours/engine_0.log $OUT/${N}_engine_0.log 2>/dev/null
  for d in $W/$N/ours/profile/step_*; do  # --profile-steps: each step's device timeline, and its traces
    [ -d "$d" ] || continue
    python3 -m slime_dsa.logging.timeline $d --top-gaps 25 > $OUT/${N}_timeline_$(basename $d).md 2>&1
    tar czf $OUT/${N}_traces_$(basename $d).tgz -C $d .
  done
}
LONG_TASK_ARGS='{"min_numbers":3,"max_numbers":3,"worked_steps":true,"worked_search":true}'  # recipes/gpu_single_sft_long.yaml's (no spaces: one word)
sft_stage() {  # NAME RECIPE STEPS TRAIN_SIZE CAP_S: `slime-dsa sft` into $W/NAME/model, unless it is there already
  stamp $1
  if [ -f $W/$1/model/config.json ] && [ -z "$SFT_FORCE" ]; then stamp "$1 model already there"; return; fi
  rm -rf $W/$1
  timeout $5 $CLI sft $2 --set trainer.num_steps=$3 \
    --set sft.eval_every=${SFT_EVAL:-100} --set logging.wandb_mode=disabled --set logging.run_dir=$W/$1 \
    --set sft.output_dir=$W/$1/model --set data.tasks.0.train_size=$4 ${SFT_SET} 2>&1 | tr "\r" "\n" | grep --line-buffered -v -e "━" -e "tokenizing" | tee $OUT/$1.log | tail -25
  cp $W/$1/metrics.jsonl $OUT/$1_metrics.jsonl 2>/dev/null
}
for s in $STAGES; do case $s in
setup)
  stamp setup
  if [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl || exit 1
    tar xJf ${WHL:-.whl}/ray-*.tar.xz -C /tmp/site || exit 1
    touch /tmp/site/.done
  fi
  # PY_SWITCH_INTERVAL (seconds) sets sys.setswitchinterval in every Python process of a stage (Ray's actors too:
  # they inherit the environment): the A/B of how long the engine thread waits to take the GIL back from the event
  # loop. Unset: Python's default, 0.005.
  printf 'import os, sys\nif os.environ.get("PY_SWITCH_INTERVAL"):\n    sys.setswitchinterval(float(os.environ["PY_SWITCH_INTERVAL"]))\n' \
    > /tmp/site/sitecustomize.py
  stamp installed
  python3 -c "import torch, pyarrow, datasets, ray, pydantic, math_verify, pebble, pybase64, transformers, triton; print('torch', torch.__version__, 'pyarrow', pyarrow.__version__, 'datasets', datasets.__version__, 'ray', ray.__version__, 'pydantic', pydantic.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tail -3
  df -h /dev/shm /tmp | tail -2; nproc; free -g | head -2
  grep -m1 "model name" /proc/cpuinfo  # the host CPU: a host-bound RL step moves with it as much as with the GPU
  ;;
test)
  stamp pytest
  timeout ${TEST_T:-240} python3 -m pytest -q -m gpu ${TEST_FILES:-tests/test_ops_gpu.py tests/test_engine_gpu.py} -p no:cacheprovider 2>&1 | tee $OUT/pytest.log | tail -30
  ;;
ptrain)
  stamp ptrain
  timeout -k 10 ${PTRAIN_T:-180} python3 benchmarks/profile_train_step.py --out $OUT/profile_train.md ${PTRAIN_ARGS} 2>&1 \
    | grep --line-buffered -v "Warning" | tail -20
  ;;
prof)
  stamp prof
  timeout ${PROF_T:-60} python3 benchmarks/profile_sft_step.py 2>&1 | tee $OUT/prof.log | grep "step s"
  ;;
sft)
  sft_stage sft recipes/gpu_single_sft.yaml ${SFT_STEPS:-300} ${SFT_TRAIN:-70000} ${SFT_T:-240}
  ;;
sftlong)
  sft_stage sftlong recipes/gpu_single_sft_long.yaml ${SFTLONG_STEPS:-200} ${SFTLONG_TRAIN:-30000} ${SFTLONG_T:-480}
  ;;
rl)
  stamp rl
  rm -rf $W/rl
  timeout -s INT -k 30 ${RL_T:-240} $CLI train ${RL_RECIPE:-recipes/gpu_single.yaml} --set model.path=$W/sft/model \
    --set logging.wandb_mode=disabled --set logging.run_dir=$W/rl --set trainer.num_steps=${RL_STEPS:-6} \
    --set data.tasks.0.train_size=${RL_TRAIN:-20000} ${RL_SET} \
    2>&1 | tr "\r" "\n" | grep --line-buffered -v -e "━" -e "tokenizing" | tee $OUT/rl.log | tail -40
  cp $W/rl/metrics.jsonl $OUT/rl_metrics.jsonl 2>/dev/null
  ;;
opd)
  stamp opd
  rm -rf $W/opd $W/opd.log
  timeout -s INT -k 30 ${OPD_T:-210} python3 benchmarks/opd_swap_gpu.py --steps ${OPD_STEPS:-6} --workdir $W/opd \
    --out $W/opd/opd_swap.md ${OPD_ARGS} 2>&1 | tr "\r" "\n" | grep --line-buffered -v -e "━" -e "tokenizing" > $W/opd.log
  { cat $W/opd/opd_swap.md 2>/dev/null || echo "no result: see the log's tail"; echo; echo "--- log tail"
    tail -n 80 $W/opd.log; } | tee $OUT/opd.log | tail -40
  ;;
abours)  # ours alone from this tree and from $AB_BASE, alternated: a change's before and after on one machine
  stamp abours
  BASE=${AB_BASE:-.stepbase}
  [ -d "$BASE" ] || { echo "no baseline tree $BASE (git archive <rev> --prefix=.stepbase/ | tar -x)"; continue; }
  MODEL=$W/sft/model; [ -d $MODEL ] || MODEL=recipes/assets/quickstart-sft
  ARGS=${AB_ARGS:-"--device cuda --task countdown --model $MODEL --prompts-per-step 64 --group-size 16 --max-new-tokens 256 --lr 1e-5 --steps 16 --ours-prefetch on --profile-steps 14 --profile-activities GPU"}
  n=0; runs=""
  for side in ${AB_ORDER:-new base base new}; do
    n=$((n + 1)); name=ab_${side}$n; dir=$PWD; [ $side = base ] && dir=$(cd $BASE && pwd)
    (cd $dir && PYTHONPATH=$dir:/tmp/site timeout -k 10 ${AB_T:-110} python3 benchmarks/vs_trl_ours.py $ARGS       --workdir $W/$name > $OUT/$name.log 2>&1)
    tail -1 $OUT/$name.log
    cp $W/$name/ours/metrics.jsonl $OUT/${name}_metrics.jsonl 2>/dev/null
    cp $W/$name/ours_result.json $OUT/${name}_result.json 2>/dev/null
    for d in $W/$name/ours/profile/step_*; do [ -d "$d" ] && python3 -m slime_dsa.logging.timeline $d > $OUT/${name}_timeline.md 2>&1; done
    rm -rf $W/$name; runs="$runs $OUT/$name"
  done
  python3 benchmarks/ab_ours.py $runs --profiled ${AB_PROFILED:-14} | tee $OUT/ab.md
  ;;
hostbench)
  stamp hostbench
  BASE=${HB_BASE:-.stepbase}
  [ -d "$BASE" ] || { echo "no baseline tree $BASE (git archive <rev> --prefix=.stepbase/ | tar -x)"; continue; }
  {
    timeout -k 10 ${HB_T:-240} python3 benchmarks/grad_bookkeeping_host_time.py --preset small --baseline-tree $BASE --rounds 5
    timeout -k 10 ${HB_T:-240} python3 benchmarks/logprob_chunks_host_time.py --rounds 5
    timeout -k 10 ${HB_T:-240} python3 benchmarks/train_call_host_time.py --preset small --baseline-tree $BASE --rounds 3 --calls 3
    timeout -k 10 ${HB_T:-240} python3 benchmarks/copy_micro_batch_host_time.py --preset small --samples 64 --length 24 --baseline-tree $BASE
  } 2>&1 | grep --line-buffered -v "Warning" | tee $OUT/hostbench.log | tail -30
  ;;
vstrl)
  vstrl_stage vstrl "--model $W/sft/model --steps 10 --prompts-per-step 16 --group-size 16 --max-new-tokens 64 --lr 1e-5 --eval-prompts 128 --out $OUT/vs_trl.md"
  ;;
vstrlrel)  # the vstrl stage with ours' engine releasing its KV cache (and CUDA graphs) at every training call: the old way
  vstrl_stage vstrl_release "--model $W/sft/model --steps 10 --prompts-per-step 16 --group-size 16 --max-new-tokens 64 --lr 1e-5 --eval-prompts 128 --ours-kv-cache release --out $OUT/vs_trl_release.md"
  ;;
vstrllong)
  vstrl_stage vstrl_long "--model $W/sftlong/model --task-args $LONG_TASK_ARGS --steps 10 --prompts-per-step 16 --group-size 16 --max-new-tokens 384 --lr 1e-5 --eval-prompts 128 --out $OUT/vs_trl_long.md"
  ;;
rollhttp)  # benchmarks/rollout_call_host_time.py on the GPU: the rollout path in process and over HTTP (the RL loop's)
  stamp rollhttp
  timeout -k 10 ${ROLLHTTP_T:-240} python3 benchmarks/rollout_call_host_time.py --device cuda --model-forward real \
    --shape 300m --batch-sizes 1024 --lengths ${ROLLHTTP_LENGTHS:-rl} --no-replay --paths inprocess,http \
    --out $OUT/rollhttp_${ROLLHTTP_LENGTHS:-rl}.json ${ROLLHTTP_ARGS} 2>&1 | grep --line-buffered -v "Warning" \
    | tee -a $OUT/rollhttp.log | tail -30
  ;;
rollspy)  # the rollhttp stage's in-process rollout under py-spy (no slowdown of the Python it samples): where the steps go
  stamp rollspy
  SPY=/tmp/site/bin/py-spy
  [ -x $SPY ] || { echo "no py-spy (the py-spy wheel missing from ${WHL:-.whl}, or setup skipped)"; continue; }
  timeout -k 10 ${ROLLSPY_T:-180} $SPY record -r 500 --threads --idle -f raw -o /tmp/rollspy.txt -- python3 \
    benchmarks/rollout_call_host_time.py --device cuda --model-forward real --shape 300m --batch-sizes 1024 \
    --lengths ${ROLLHTTP_LENGTHS:-rl} --no-replay --paths inprocess --out $OUT/rollspy.json ${ROLLSPY_ARGS} 2>&1 \
    | grep --line-buffered -v "Warning" | tail -5
  python3 benchmarks/spy_steps.py /tmp/rollspy.txt --top 40 | tee $OUT/rollspy.md | head -45
  ;;
rlspy)  # the rl stage's 64 x 16 loop with py-spy attached to the engine actor and the trainer rank after step 1
  stamp rlspy
  SPY=/tmp/site/bin/py-spy
  [ -x $SPY ] || { echo "no py-spy (the py-spy wheel missing from ${WHL:-.whl}, or setup skipped)"; continue; }
  rm -rf $W/rlspy /tmp/rlspy_*.txt
  model_arg=$([ -d $W/sft/model ] && echo "--set model.path=$W/sft/model" || echo "")
  timeout -s INT -k 30 ${RLSPY_T:-200} $CLI train recipes/gpu_single.yaml $model_arg --set logging.wandb_mode=disabled \
    --set logging.run_dir=$W/rlspy --set trainer.num_steps=${RLSPY_STEPS:-30} --set data.tasks.0.train_size=20000 \
    ${RL_SET} > $W/rlspy.log 2>&1 &
  run=$!
  until [ -s $W/rlspy/metrics.jsonl ] || ! kill -0 $run 2>/dev/null; do sleep 0.5; done
  for actor in EngineActor FSDPWorker; do
    pid=$(pgrep -f "^ray::$actor" | head -1)
    [ -n "$pid" ] && $SPY record --pid $pid -r ${RLSPY_RATE:-250} -d ${RLSPY_D:-12} --threads --idle --nonblocking \
      -f raw -o /tmp/rlspy_$actor.txt > /tmp/rlspy_$actor.log 2>&1 &
  done
  wait
  { tail -n 3 /tmp/rlspy_*.log; python3 benchmarks/spy_steps.py /tmp/rlspy_EngineActor.txt --top 40 --threads
    echo; python3 benchmarks/spy_steps.py /tmp/rlspy_FSDPWorker.txt --top 40 --every-process; } > $OUT/rlspy.md 2>&1
  head -60 $OUT/rlspy.md
  grep -v "━" $W/rlspy.log | tail -15 > $OUT/rlspy.log
  cp $W/rlspy/metrics.jsonl $OUT/rlspy_metrics.jsonl 2>/dev/null
  ;;
trlnan)  # benchmarks/trl_nan_check.py: where TRL's backward turns non-finite on the long-answer policy (issue 19)
  stamp trlnan
  timeout -k 10 ${TRLNAN_T:-420} python3 benchmarks/trl_nan_check.py --device cuda --model $W/sftlong/model \
    --task-args $LONG_TASK_ARGS --rounds 4 ${TRLNAN_ARGS} 2>&1 \
    | grep --line-buffered -v -e "Warning" -e "warn(" -e "detect_anomaly" | tee $OUT/trlnan.log | tail -40
  ;;
steps)  # benchmarks/step_overheads.py: the RL step's engine requests and trainer calls between rollouts, by phase
  stamp steps
  model_arg=$([ -d $W/sft/model ] && echo "--model $W/sft/model" || echo "--preset small")
  timeout -k 10 ${STEPS_T:-420} python3 benchmarks/step_overheads.py --device cuda $model_arg --steps 12 \
    --prompts-per-step 16 --group-size 16 --max-new-tokens 64 ${STEPS_ARGS} 2>&1 \
    | grep --line-buffered -v -e "Warning" -e "━" | tee $OUT/step_overheads.log | tail -60
  ;;
mgbench)
  stamp mgbench
  python3 -c "import megatron.core; print('megatron-core', megatron.core.__version__)" 2>&1 | tail -1
  timeout -k 20 ${MGBENCH_T:-400} python3 benchmarks/megatron_vs_fsdp.py --workdir $W/mgbench --layerwise \
    --profile-dir $OUT ${MGBENCH_ARGS} --out $OUT/megatron_vs_fsdp.json 2>&1 | grep --line-buffered -v -e "warnings.warn" -e "Warning:" \
    | tee $OUT/megatron_vs_fsdp.log | tail -40
  ;;
engthr)
  stamp engthr
  timeout -k 10 ${ENGTHR_T:-150} python3 benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --preset 300m \
    --new-tokens 128 --batch-sizes ${ENGTHR_BATCHES:-256,1024} --hf-batch-sizes ${ENGTHR_HF:-256} --group-size 16 \
    --no-eager --release-kv ${ENGTHR_ARGS} 2>&1 | tr "\r" "\n" | grep --line-buffered -v "Loading weights" | tee $OUT/engthr.log | tail -40
  ;;
kern20)
  # issue 20's newer kernels: the GPU tests of the Gluon kernels and the sampled select, then the
  # forward's benchmark (KERN20_TEST_T, KERN20_FWD_T cap them, default 200 / 270 s)
  stamp kern20
  timeout -k 10 ${KERN20_TEST_T:-200} python3 -m pytest -q -m gpu tests/test_ops_gpu.py \
    -k "gluon or sampled" -p no:cacheprovider 2>&1 | tee $OUT/kern20_pytest.log | tail -15
  timeout -k 10 ${KERN20_FWD_T:-270} python3 benchmarks/sparse_mla_fwd_variants.py --variants idx_reg gluon_n64_s2 \
    gluon_ws_n64_s2 gluon_ws_n32_s4 gluon_ws_overlap_n32_s4 gluon_n64_s2_rowsum_each_step gluon_n32_s4 gluon_overlap_n32_s3 \
    gluon_overlap_n32_s4 --top 0 --budget 0.3 \
    --time-limit $(( ${KERN20_FWD_T:-270} - 30 )) --out $OUT/kern20_fwd.json 2>&1 | grep -v Warning | tail -40
  ;;
kern20b)
  # the sampled select against the split one, then the Gluon backward (dKV half, both halves, fused) against split64
  stamp kern20b
  timeout -k 10 ${KERN20_SEL_T:-150} python3 benchmarks/paged_indexer_variants.py --out $OUT/kern20_select.json 2>&1 \
    | grep -v Warning | tail -40
  timeout -k 10 ${KERN20_BWD_T:-300} python3 benchmarks/sparse_mla_bwd_variants.py \
    --modes split64 split64_gluon_dkv gluon_split gluon_fused --max-configs 1 \
    --time-limit $(( ${KERN20_BWD_T:-300} - 60 )) --out $OUT/kern20_bwd.json 2>&1 | grep -v Warning | tail -30
  ;;
table20)
  # issue 20's table as its acceptance asks (32K-128K, the KL loss at every length, decode batches 32 and 128), then
  # the Triton-only baseline in the same call; the kernels' GPU tests first (TABLE20_TEST_T, TABLE20_T cap them,
  # default 200 / 300 s). Writes $OUT/table20_pytest.log, table20.md, table20_triton.md.
  stamp table20
  timeout -k 10 ${TABLE20_TEST_T:-200} python3 -m pytest -q -m gpu tests/test_ops_gpu.py -p no:cacheprovider \
    -k "gluon or sampled or indexer or kl or bwd_delta or model_forward_backward" 2>&1 | tee $OUT/table20_pytest.log | tail -5
  timeout -k 10 ${TABLE20_T:-300} python3 benchmarks/dsa_kernels.py --lengths 32768 65536 131072 --no-packed \
    --decode-batches 32 128 --kl-max-len 131072 --no-before --time-limit $(( ${TABLE20_T:-300} - 60 )) \
    --out $OUT/table20.md 2>&1 | grep "^\[" | tail -20
  timeout -k 10 ${TABLE20_T:-300} python3 benchmarks/dsa_kernels.py --lengths 32768 65536 131072 --no-packed \
    --decode-batches --kl-max-len 131072 --no-before --no-gluon --time-limit $(( ${TABLE20_T:-300} - 60 )) \
    --out $OUT/table20_triton.md 2>&1 | grep "^\[" | tail -12
  ;;
invk)
  stamp invk
  timeout -k 10 ${INVK_T:-420} python3 benchmarks/invariant_kernels.py --out $OUT/invk.md ${INVK_ARGS} 2>&1 \
    | tee $OUT/invk.log | tail -20
  ;;
tonp)
  stamp tonp
  timeout -s INT -k 30 ${TONP_T:-420} python3 benchmarks/true_on_policy.py --device cuda --recipe recipes/gpu_single.yaml \
    --steps ${TONP_STEPS:-20} --set model.path=$W/sft/model --set data.tasks.0.train_size=20000 ${TONP_ARGS} \
    --out $OUT/tonp.md 2>&1 | tr "\r" "\n" | grep --line-buffered -v -e "━" -e "tokenizing" | tee $OUT/tonp.log | tail -30
  ;;
ds)
  stamp ds
  python3 -c "import deepspeed" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site ${WHL:-.whl}/{deepspeed,hjson,py_cpuinfo,ninja,einops,msgpack,psutil}-*.whl
  ( export CUDA_VISIBLE_DEVICES=${DS_GPU:-0}
    python3 -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'torch', torch.__version__)"
    timeout -k 10 ${DS_TEST_T:-120} python3 -m pytest -q -s -m gpu tests/test_deepspeed_gpu.py -p no:cacheprovider
    stamp capacity
    timeout -k 30 ${DSCAP_T:-210} python3 benchmarks/deepspeed_capacity.py ${DSCAP_ARGS:---backend both --steps 1 --budget-s 190 --attempt-s 140}
  ) 2>&1 | grep --line-buffered -v "FutureWarning\|return func" | tee $OUT/deepspeed.log | tail -40
  ;;
esac; done
stamp done
# Ray's session logs, for post-mortems (one archive: $OUT returns at most 8 files)
[ -z "$NO_RAYLOGS" ] && tar czf $OUT/raylogs.tgz -C /tmp/ray session_latest/logs 2>/dev/null; ls -la $OUT
