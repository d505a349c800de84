#!/usr/bin/env bash
# The format-restriction study of issue 16 (Tam et al. 2024, "Let Me Speak Freely?") on a model
# trained here: write the task set's training documents, train a 1M-parameter Llama on them, run
# eval-format on it, and time constrained decoding against free decoding on the same model.
#
#   bench/format_study.sh [TASKS_PER_KIND]      # from the repository root; results in bench/out/format-study
#
# Training mix (lmforge/structured/tasks.py, TRAINING_MIX): 40% free-text replies, 40% JSON/YAML/
# XML replies (the six format x key-order templates in turn), 20% free replies followed by their
# conversion to a format (reasoning first); questions from the train split only (eval-format asks
# test-split questions: no question is shared).
set -euo pipefail
PY=${PYTHON:-python}
TASKS=${1:-20}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a 1M-parameter model gains nothing from a second thread

nice -n 10 $PY -m lmforge tasks --out data/tasks.jsonl -n 30000
nice -n 10 $PY -m lmforge train --model tiny data.source=data/tasks.jsonl model.vocab_size=1024 model.d_model=128 \
    model.n_layers=4 model.n_heads=4 model.n_kv_heads=2 model.max_seq_len=256 train.batch_size=16 \
    train.max_steps=800 optim.lr=3e-3 optim.warmup_steps=50 train.eval_interval=200 \
    train.checkpoint_interval=200 train.sample_tokens=0 --name tasks --no-progress
nice -n 10 $PY -m lmforge eval-format runs/tasks --tasks "$TASKS" --out bench/out/format-study
nice -n 10 $PY bench/structured.py --run runs/tasks
