"""bench/throughput.py end to end on a tiny override of its GPT-2 shape, eager pair only, so that
the harness (sides in lockstep in their own processes, the table, the ratio) cannot rot between
the rare full runs. Measures nothing."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpt2_shape_runs_on_data_of_its_own_vocabulary(tmp_path, corpus_dir):
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
            "model.max_seq_len=32", "train.batch_size=2", f"data.source={corpus_dir}"]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--shapes", "gpt2",
                           "--precisions", "fp32", "--pairs", "eager", "--steps", "2", "--warmup", "1",
                           "--scratch", str(tmp_path / "scratch"), *tiny],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    # the shape keeps GPT-2's vocabulary (the overrides leave it alone) and trains on a folder
    # prepared for it, not on the default shape's (whose 4096-token tokenizer prepare would refuse)
    assert re.search(r"^gpt2 \(1 layers, d_model 32, vocab 50257, context 32\), fp32", done.stdout, re.M)
    assert [p.name.rsplit("-bpe", 1)[1] for p in (tmp_path / "data").iterdir()] == ["50257"]
    assert len(re.findall(r"^(ours|reference) +[\d,]+ +\d+\.\d{3} ", done.stdout, re.M)) == 2
    assert re.search(r"^ratio ours/reference \(tokens/s\): eager \d+\.\d{3}$", done.stdout, re.M)
