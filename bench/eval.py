"""Multiple-choice scoring speed: lmforge's scorer against lm-evaluation-harness's HFLM, in one run,
on the same exported Hugging Face folder and the same items.

    nice -n 10 python bench/eval.py [--model RUN_OR_HF_FOLDER] [--tasks arc_easy,hellaswag,piqa]
                                    [--limit 100] [--batch-sizes 1,16] [--threads 1]

The model (default: the default run's shape, the `small` preset, with 1,024 positions so that no
context is truncated, random weights, and a 4,096-token BPE tokenizer trained here on the tasks'
text) is exported with lmforge's export_hf; a run folder given with --model is exported the same way.
lmforge scores the questions with score_questions (each context once, every choice from its KV
cache), one question per call and then as `lmforge eval` does, eval/run.py's CHUNK questions per call
(batched across questions, right-padded); lm-eval's HFLM scores every (context, continuation) request, batched at each of
--batch-sizes (its default is 1), sorted by length as it sorts them. Both include tokenization.
Printed per task: questions/s of each, lm-eval's time over lmforge's batched time, and the largest
difference of the log-likelihoods (batched lmforge against each lm-eval).
"""

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.config import make_config  # noqa: E402
from lmforge.data.corpus import END_OF_TEXT, train_tokenizer  # noqa: E402
from lmforge.eval.run import CHUNK  # noqa: E402
from lmforge.eval.score import score_questions  # noqa: E402
from lmforge.eval.tasks import load_questions  # noqa: E402
from lmforge.interop.hf import export_hf  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402
from lmforge.runs.folders import export_run  # noqa: E402
from lmforge.runs.load import load_model, model_folder  # noqa: E402


def built_model(out: Path, texts: list[str]) -> Path:
    cfg = make_config("small", overrides=["model.max_seq_len=1024"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    export_hf(cfg, model.state_dict(), tokenizer, out, end_token=END_OF_TEXT)
    return out


def time_lmforge(folder: Path, questions, chunk: int) -> tuple[float, list[float]]:
    loaded = load_model(folder, "fp32")
    start, lls = time.perf_counter(), []
    for at in range(0, len(questions), chunk):
        pairs = [(q.contexts, q.continuations) for q in questions[at:at + chunk]]
        for scored, _ in score_questions(loaded.model, loaded.tokenizer, pairs, loaded.end_id):
            lls += [s.logprob for s in scored]
    return time.perf_counter() - start, lls


def time_lm_eval(folder: Path, questions, batch_size: int) -> tuple[float, list[float]]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=batch_size)
    pairs = [(c, k) for q in questions for c, k in zip(q.contexts, q.continuations)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    start = time.perf_counter()
    lls = [ll for ll, _ in model.loglikelihood(requests, disable_tqdm=True)]
    return time.perf_counter() - start, lls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a run folder or Hugging Face folder (default: built here)")
    parser.add_argument("--tasks", default="arc_easy,hellaswag,piqa")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both (1: steady on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    tasks = {t: load_questions(t, "rc", 0, args.limit) for t in args.tasks.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            texts = [c + k for qs in tasks.values() for q in qs for c, k in zip(q.contexts, q.continuations)]
            folder = built_model(Path(tmp) / "hf", texts)
        elif model_folder(args.model)[0] == "hf":
            folder = Path(args.model)
        else:
            folder = export_run(args.model, Path(tmp) / "hf")
        print(f"model: {args.model or 'small preset, 1024 positions, random weights'}; torch threads "
              f"{torch.get_num_threads()}")
        print(f"{'task':<12}{'questions':>10}{'lmforge 1 q/s':>15}{f'lmforge {CHUNK} q/s':>16}" +
              "".join(f"{f'lm-eval b{b} q/s':>17}{'ratio':>8}" for b in args.batch_sizes.split(",")) +
              f"{'max |dll|':>11}")
        for task, questions in tasks.items():
            single, _ = time_lmforge(folder, questions, 1)
            ours, lls = time_lmforge(folder, questions, CHUNK)
            line = f"{task:<12}{len(questions):>10}{len(questions) / single:>15.2f}{len(questions) / ours:>16.2f}"
            worst = 0.0
            for batch in map(int, args.batch_sizes.split(",")):
                theirs, reference = time_lm_eval(folder, questions, batch)
                line += f"{len(questions) / theirs:>17.2f}{theirs / ours:>8.2f}"
                worst = max(worst, max(abs(a - b) for a, b in zip(lls, reference)))
            print(line + f"{worst:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
