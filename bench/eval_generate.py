"""Generation-task decoding speed: one prompt at a time against many in one batch, in one run, on the
same model and the same items (GSM8K by default), with lm-eval's HFLM `generate_until` beside them.

    nice -n 10 python bench/eval_generate.py [--model RUN_OR_HF_FOLDER] [--tasks gsm8k] [--limit 16]
                                             [--max-new-tokens 64] [--chunk 16] [--lm-eval-batch-sizes 16]
                                             [--threads 1]

The model is bench/eval.py's (default: the `small` preset with 1,024 positions, random weights, a
4,096-token BPE tokenizer trained here on the prompts' text), exported to a Hugging Face folder and
loaded as `lmforge eval` loads it, in fp32. lmforge decodes greedily with eval/generation.py's
`complete` (generate/sampling.py's generate_batch), first one prompt per call, then --chunk prompts
per call as `lmforge eval` does (eval/run.py's GENERATION_CHUNK), each row stopping at its task's stop
sequences or after --max-new-tokens. Both include tokenization; neither runs the code tasks' tests.
Printed per task: prompts/s of each, the batched speed-up, the new tokens made, whether the batched
completions equal the one-at-a-time ones, GSM8K's exact match of each; and, for each of
--lm-eval-batch-sizes (none: leave it out), lm-eval's prompts/s and how many of its completions equal
lmforge's (its stop handling and prompt truncation are its own: a difference there is not an error).
"""

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval import built_model  # noqa: E402 (bench/eval.py's model)
from lmforge.eval.generation import complete, gsm8k_correct  # noqa: E402
from lmforge.eval.run import GENERATION_CHUNK  # noqa: E402
from lmforge.eval.tasks import load_prompts  # noqa: E402
from lmforge.runs.folders import export_run  # noqa: E402
from lmforge.runs.load import load_model, model_folder  # noqa: E402


def time_lmforge(loaded, prompts, chunk: int, max_new_tokens: int) -> tuple[float, list[str]]:
    start, texts = time.perf_counter(), []
    for at in range(0, len(prompts), chunk):
        texts += [text for text, _ in complete(loaded.model, loaded.tokenizer, prompts[at:at + chunk],
                                               (loaded.end_id,), max_new_tokens)]
    return time.perf_counter() - start, texts


def time_lm_eval(folder: Path, prompts, batch_size: int, max_new_tokens: int) -> tuple[float, list[str]]:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=batch_size)
    requests = [Instance("generate_until", {}, (p.context, {"until": p.stops, "max_gen_toks": max_new_tokens,
                                                            "do_sample": False}), i) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    texts = model.generate_until(requests, disable_tqdm=True)
    return time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a run folder or Hugging Face folder (default: built here)")
    parser.add_argument("--tasks", default="gsm8k")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=GENERATION_CHUNK)
    parser.add_argument("--lm-eval-batch-sizes", default="16", help="comma-separated; empty: lm-eval is not run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    tasks = {t: load_prompts(t, None, args.limit) for t in args.tasks.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            folder = built_model(Path(tmp) / "hf", [p.context + p.gold for ps in tasks.values() for p in ps])
        elif model_folder(args.model)[0] == "hf":
            folder = Path(args.model)
        else:
            folder = export_run(args.model, Path(tmp) / "hf")
        loaded = load_model(folder, "fp32")
        sizes = [int(b) for b in args.lm_eval_batch_sizes.split(",") if b]
        print(f"model: {args.model or 'small preset, 1024 positions, random weights'}; torch threads "
              f"{torch.get_num_threads()}; at most {args.max_new_tokens} new tokens")
        print(f"{'task':<16}{'prompts':>8}{'1 at a time p/s':>17}{f'{args.chunk} per batch p/s':>18}{'speed-up':>10}"
              f"{'new tokens':>12}{'same':>6}{'exact 1 / batch':>17}" +
              "".join(f"{f'lm-eval b{b} p/s':>17}{'same':>6}" for b in sizes))
        for task, prompts in tasks.items():
            single, alone = time_lmforge(loaded, prompts, 1, args.max_new_tokens)
            batched, texts = time_lmforge(loaded, prompts, args.chunk, args.max_new_tokens)
            made = sum(len(loaded.tokenizer.encode(t).ids) for t in texts)
            exact = "-"
            if task == "gsm8k":
                exact = "/".join(str(sum(gsm8k_correct(t, p.doc) for t, p in zip(out, prompts)))
                                 for out in (alone, texts))
            line = (f"{task:<16}{len(prompts):>8}{len(prompts) / single:>17.2f}{len(prompts) / batched:>18.2f}"
                    f"{single / batched:>10.2f}{made:>12}{str(texts == alone):>6}{exact:>17}")
            for batch in sizes:
                theirs, reference = time_lm_eval(folder, prompts, batch, args.max_new_tokens)
                line += f"{len(prompts) / theirs:>17.2f}{sum(a == b for a, b in zip(texts, reference)):>6}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
