"""Cost per generated token of JSON-constrained decoding against unconstrained generation.

    python bench/structured.py [--run RUN] [--model small] [--tokens 128] [--samples 8] [--rounds 3]
                               [--schema s.json | --format yaml|xml]

Same model, prompt, sampling (temperature 1.0, top-p 0.95) and seeds both ways, with the KV cache,
in one process. Time per token is the total wall time over the total tokens generated; the free
run generates as many tokens per seed as the constrained answer had (no stop token), so both
decode at the same positions. Without --run the model is an
untrained preset (its random logits make the grammar work hard: long strings, many keys) and the
tokenizer is trained here on the first ~600 KB of the standard library, at the preset's vocabulary.
`--format yaml` or `xml` times eval-format's fixed-key Lark grammars (lmforge/structured/constrain.py)
instead of JSON (rows still say json: the constrained mode). The grammar part is also timed alone:
computing each mask (llguidance bitmask to a boolean tensor) and advancing the matcher by the
chosen token.
"""

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.config import load_config, make_config  # noqa: E402
from lmforge.data.corpus import END_OF_TEXT, load_tokenizer, train_tokenizer  # noqa: E402
from lmforge.generate.sampling import generate  # noqa: E402
from lmforge.model.transformer import Transformer  # noqa: E402
from lmforge.structured.constrain import format_grammar  # noqa: E402
from lmforge.structured.constrain import GrammarConstraint, JsonMode, load_schema  # noqa: E402


def stdlib_texts(limit: int = 600_000):
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8")
        yield text
        total += len(text)
        if total > limit:
            return


def load(args):
    if args.run:
        from lmforge.runs.checkpoint.find import find_checkpoint
        from lmforge.runs.checkpoint.read import load_model_weights

        path = find_checkpoint(args.run)
        model = Transformer(load_config(path / "config.yaml").model)
        load_model_weights(model, path)
        return model, load_tokenizer(path / "tokenizer.json"), f"run {args.run}"
    cfg = make_config(args.model).model
    torch.manual_seed(0)
    return Transformer(cfg), train_tokenizer(stdlib_texts(), cfg.vocab_size), f"untrained {args.model}"


class TimedConstraint(GrammarConstraint):
    """Adds up the time spent in the grammar engine: masks and matcher updates."""

    seconds = 0.0

    def allowed(self, vocab_size):
        start = time.perf_counter()
        mask = super().allowed(vocab_size)
        TimedConstraint.seconds += time.perf_counter() - start
        return mask

    def consume(self, token):
        start = time.perf_counter()
        super().consume(token)
        TimedConstraint.seconds += time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", help="an lmforge run folder (default: an untrained --model)")
    parser.add_argument("--model", default="small", help="preset when no --run is given")
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens per sample")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="turns each mode takes; the fastest counts")
    parser.add_argument("--schema", help="a JSON Schema file (default: any JSON object)")
    parser.add_argument("--format", default="json", choices=("json", "yaml", "xml"),
                        help="yaml, xml: eval-format's grammars (keys reasoning, answer) instead of JSON")
    args = parser.parse_args()
    model, tokenizer, what = load(args)
    model.eval()
    end = tokenizer.token_to_id(END_OF_TEXT)
    prompt = tokenizer.encode("answer = ").ids
    grammar = format_grammar("string", args.format, "reasoning-first") if args.format != "json" else None
    json_mode = JsonMode(tokenizer, end, load_schema(args.schema) if args.schema else None, grammar)
    sampling = dict(temperature=1.0, top_p=0.95)
    generate(model, prompt, 8, **sampling)  # warm-up

    # JSON first; then free generation of exactly as many tokens per seed, so both modes decode at
    # the same positions (an answer that closes early would otherwise look cheap: shorter contexts).
    # The modes take turns --rounds times and each keeps its fastest round (other load is noise).
    results = {}
    for _ in range(args.rounds):
        lengths = []
        for mode in ("json", "free"):
            tokens, start = 0, time.perf_counter()
            TimedConstraint.seconds = 0.0
            for seed in range(args.samples):
                if mode == "json":
                    ids = generate(model, prompt, args.tokens, seed=seed, stop_token=end,
                                   constraint=TimedConstraint(json_mode.constraint().matcher), **sampling)
                    lengths.append(len(ids))
                else:
                    ids = generate(model, prompt, lengths[seed], seed=seed, **sampling)
                tokens += len(ids)
            measured = (tokens, (time.perf_counter() - start) / tokens, TimedConstraint.seconds / tokens)
            if mode not in results or measured[1] < results[mode][1]:
                results[mode] = measured

    print(f"# {args.format} grammar, {what}, vocab {model.cfg.vocab_size}, {args.samples} samples x up to {args.tokens} tokens, "
          f"KV cache, temperature 1.0, top-p 0.95, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| mode | tokens | ms/token | of which grammar engine |")
    print("|---|---:|---:|---:|")
    for mode, (tokens, per_token, mask) in results.items():
        print(f"| {mode} | {tokens} | {per_token * 1e3:.3f} | {mask * 1e3:.3f} |")
    print(f"constrained / free time per token: {results['json'][1] / results['free'][1]:.2f}x")


if __name__ == "__main__":
    main()
