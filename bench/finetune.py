"""Full fine-tuning against LoRA ranks 4, 16 and 64 on the same base and the same task.

The task, generated from the embedded corpus (this Python's standard library): given a function's
docstring, write its signature. Each example is

    {"prompt": the first paragraph of the docstring in triple quotes and a newline,
     "response": "def name(args):"}

and the loss is taken on the response only (lmforge/data/sft.py). Every setup trains from the same
base (the default `lmforge train` model: give its run folder) with the same seed, batches, steps and
learning-rate schedule; the script prints trainable parameters, the gradient + optimizer bytes
measured after the first step (beside the plan's), tokens/s and the validation loss after the same
number of steps, and draws the validation curves and the bytes. It also prints the bytes each rank
would send per step under DDP on 8 ranks (accounting/comm.py; tests/test_engines_compose.py checks
that count equal to the collectives our DDP and ZeRO really call, at 2 ranks): they follow the
trainable parameters, so LoRA sends a small fraction of full fine-tuning's gradients.

    python bench/finetune.py --base runs/<default run> [--steps 100] [--lr 1e-3]
"""

import argparse
import ast
import json
import time
from pathlib import Path

from rich.console import Console

from lmforge.accounting.comm import step_communication
from lmforge.config import load_config, make_config
from lmforge.data.corpus import stdlib_documents
from lmforge.runs.load import base_checkpoint
from lmforge.train.loop import Trainer

OUT = Path(__file__).parent / "out"
COMM_RANKS = 8  # the data-parallel degree of the bytes-sent column
SETUPS = [("full", None), ("LoRA r=4", 4), ("LoRA r=16", 16), ("LoRA r=64", 64)]


def signature_pairs(limit: int, max_prompt_chars: int = 160) -> list[dict]:
    """Docstring -> signature pairs of the standard library's functions, in corpus order."""
    pairs = []
    for doc in stdlib_documents():
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:  # a test file that is broken on purpose
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            docstring = ast.get_docstring(node)
            if not docstring:
                continue
            summary = docstring.split("\n\n")[0].strip()
            if not summary or len(summary) > max_prompt_chars:
                continue
            keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
            pairs.append({"prompt": f'"""{summary}"""\n', "response": f"{keyword} {node.name}({ast.unparse(node.args)}):"})
            if len(pairs) == limit:
                return pairs
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="run folder of the base model (the default lmforge train run)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--seq-len", type=int, default=96)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    data = OUT / "signatures.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in signature_pairs(args.examples)))
    base = Path(args.base).resolve()
    base_model = load_config(base_checkpoint(base) / "config.yaml").model
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for label, rank in SETUPS:
        overrides = [f"finetune.base={base}", f"data.source={data}", f"train.seq_len={args.seq_len}",
                     f"train.max_steps={args.steps}", f"optim.lr={args.lr}", "optim.warmup_steps=10",
                     f"train.eval_interval={max(args.steps // 5, 1)}", "train.eval_batches=4",
                     f"train.checkpoint_interval={args.steps}", "train.sample_tokens=0", "train.tensorboard=false",
                     "train.device=cpu"]
        if rank:
            overrides.append(f"finetune.lora_rank={rank}")
        cfg = make_config(None, overrides=overrides)
        cfg.model = base_model
        run_dir = OUT / "finetune_runs" / f"{stamp}-{label.replace(' ', '').replace('=', '')}"
        trainer = Trainer(cfg, run_dir, console=Console(quiet=True), progress=False)
        trainable = sum(p.numel() for p in dict.fromkeys(trainer.model.parameters()) if p.requires_grad)
        summary = trainer.run()
        compared = summary["predicted_vs_measured"]
        measured = compared["gradients_bytes"]["measured"] + compared["optimizer_states_bytes"]["measured"]
        planned = compared["gradients_bytes"]["predicted"] + compared["optimizer_states_bytes"]["predicted"]
        curve = [(r["step"], r["val_loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in r]
        lora = (rank, cfg.finetune.lora_targets) if rank else None
        sent = step_communication(base_model, "ddp", COMM_RANKS, lora=lora)["sent_bytes"]
        rows.append({"setup": label, "trainable": trainable, "grad_opt_bytes": measured, "planned_bytes": planned,
                     "ddp_sent_bytes": sent,
                     "tokens_per_s": summary["tokens_per_s"], "val_loss": summary["val_loss"], "curve": curve})
        print(f"{label:10s} trainable {trainable:>9,}  grad+opt {measured / 2**20:8.2f} MiB (plan "
              f"{planned / 2**20:.2f})  DDP x{COMM_RANKS} sends {sent / 2**20:8.2f} MiB/step  "
              f"{summary['tokens_per_s']:>8,.0f} tok/s  val loss {summary['val_loss']:.4f}", flush=True)
    full = rows[0]
    print(f"\n| setup | trainable params | grad + optimizer bytes (measured = plan) | / full | "
          f"sent per step per rank, DDP x{COMM_RANKS} | / full | tokens/s | / full | val loss after {args.steps} steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "yes" if r["grad_opt_bytes"] == r["planned_bytes"] else "NO"
        print(f"| {r['setup']} | {r['trainable']:,} | {r['grad_opt_bytes'] / 2**20:.2f} MiB ({same}) | "
              f"{r['grad_opt_bytes'] / full['grad_opt_bytes']:.3f} | {r['ddp_sent_bytes'] / 2**20:.2f} MiB | "
              f"{r['ddp_sent_bytes'] / full['ddp_sent_bytes']:.4f} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / full['tokens_per_s']:.2f} | {r['val_loss']:.4f} |")
    (OUT / "finetune.json").write_text(json.dumps(rows, indent=2))
    plot(rows, Path(__file__).parent / "finetune.png", args)


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for r in rows:
        steps, losses = zip(*r["curve"])
        curves.plot(steps, losses, marker="o", label=f"{r['setup']}: {r['val_loss']:.3f}")
    curves.set_xlabel("step")
    curves.set_ylabel("validation loss (response tokens)")
    curves.set_title(f"docstring -> signature, lr {args.lr:g}, {args.steps} steps", fontsize=9)
    curves.legend(fontsize=8)
    names = [r["setup"] for r in rows]
    bars.bar(names, [r["grad_opt_bytes"] / 2**20 for r in rows], color="tab:orange")
    for i, r in enumerate(rows):
        bars.text(i, r["grad_opt_bytes"] / 2**20, f"{r['trainable']:,}\nparams", ha="center", va="bottom", fontsize=7)
    bars.set_yscale("log")
    bars.set_ylabel("gradient + AdamW state, MiB (measured)")
    bars.set_title("what training holds besides the weights", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
