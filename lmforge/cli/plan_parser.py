"""The parser of `lmforge plan`: its many options, in two groups (lmforge/cli/plan_options.py reads them:
the setup flags are aliases of config keys, the others the world and the machine)."""

import argparse

from lmforge.cli.arguments import COUNT, add_config_args, add_run, describe, number, picture
from lmforge.modes import BACKENDS, OPTIMIZER_MODES, POLICIES, PRECISION_ALIASES, RECOMPUTE_MODES


def add_plan(plan) -> None:
    describe(plan, (
        "Print what a training setup costs: parameters, FLOPs per token and per step, memory per "
        "device with its breakdown (and whether it fits), time per step at an assumed MFU, and the "
        "time, FLOPs and device-hours of a token budget. With --inference, what serving costs: "
        "weights, KV cache, prefill and decode time, the largest batch that fits. The config is built "
        "and validated as `lmforge train` builds it (--model, --config, section.key=value); the setup "
        "flags are aliases of its keys (--batch-size: train.batch_size, --pp: parallel.pp, "
        "--zero-stage N: train.parallel=zeroN, ...: docs/planning.md). Options marked LIST take several "
        "values separated by commas with --compare."), (
        "examples:\n"
        "  lmforge plan                                   # the default model on this machine\n"
        "  lmforge plan --model gpt3-175b --batch-size 128 --seq-len 2048 --precision fp16 \\\n"
        "      --recompute none --json\n"
        "  lmforge plan --model llama3-70b --batch-size 1 --seq-len 8192 --precision bf16-mixed \\\n"
        "      --zero-stage 3 --dp 64 --recompute full --hardware h100-sxm --tokens 15e12 --plot plan.png\n"
        "  lmforge plan --model llama3-8b --seq-len 8192 --precision bf16-mixed --hardware h100-sxm --dp 8 \\\n"
        "      --compare --zero-stage 0,1,2,3 --recompute none,full --plot compare.png\n"
        "  lmforge plan --model llama3-70b --seq-len 8192 --precision bf16-mixed --hardware h100-sxm \\\n"
        "      --zero-stage 3 --recompute full --sequence-parallel --solve devices\n"
        "  lmforge plan --model llama3-8b train.precision=bf16-mixed parallel.tp=8 --dp 4 --hardware h100-sxm\n"
        "  lmforge plan --pp 4 train.micro_batches=8 train.schedule=1f1b   # per-stage memory, the bubble\n"
        "  lmforge plan --inference --model llama3-8b --batch-size 8 --seq-len 8192 --weights int4 \\\n"
        "      --hardware h100-sxm\n"
        "  lmforge plan --inference ~/models/Llama-3.2-1B --seq-len 4096   # a Hugging Face folder\n"
        "  lmforge plan --dtypes"))
    add_run(plan, "plan the model of this run folder or Hugging Face folder (instead of --model); its stored "
                  "dtype is --inference's default --weights and --kv-dtype", required=False)
    add_config_args(plan)
    _add_plan_setup(plan)
    _add_plan_costs(plan)


def _add_plan_setup(plan: argparse.ArgumentParser) -> None:
    """What is planned: batch, sequence, precision, parallelism, recomputation, attention."""
    # Several values (comma-separated) are accepted with --compare; each is checked in cmd_plan.
    plan.add_argument("--batch-size", metavar="LIST", help="sequences per micro-batch per data-parallel rank "
                                                           "(--inference: sequences decoded together)")
    plan.add_argument("--seq-len", metavar="LIST", help="tokens per sequence (--inference: the context)")
    plan.add_argument("--grad-accum", type=COUNT, help="micro-batches per optimizer step")
    aliases = ", ".join(f"{alias} = {name}" for alias, name in PRECISION_ALIASES.items())
    plan.add_argument("--precision", metavar="LIST", help=f"{', '.join(POLICIES)} (or {aliases})")
    plan.add_argument("--optimizer", metavar="LIST", help=f"{', '.join(OPTIMIZER_MODES)} (default: "
                                                           f"the config's optim.name, adamw)")
    plan.add_argument("--zero-stage", metavar="LIST", help="ZeRO stage 0-3: train.parallel=zeroN (shards over --dp)")
    plan.add_argument("--dp", metavar="LIST", help="data-parallel degree (default 1; not a config key)")
    plan.add_argument("--dp-shard", type=COUNT, help="data-parallel ranks that shard the states, parallel.dp_shard "
                                                     "(FSDP unless --zero-stage; with --dp-replicate: hybrid sharding)")
    plan.add_argument("--dp-replicate", type=COUNT, help="data-parallel ranks that replicate, parallel.dp_replicate "
                                                         "(dp = dp_replicate x dp_shard)")
    plan.add_argument("--tp", metavar="LIST", help="tensor-parallel degree (default 1)")
    plan.add_argument("--cp", metavar="LIST", help="context-parallel degree, parallel.cp (default 1): each rank holds "
                                                 "seq/cp tokens, ring attention (docs/context-parallel.md)")
    plan.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                      help="with --tp: parallel.sequence_parallel, norms and layer inputs split along the "
                           "sequence too (default off; Korthikanti et al. 2022 table 2 has both)")
    plan.add_argument("--pp", metavar="LIST", help="pipeline stages: the same as parallel.pp (default 1); "
                                                 "micro-batches and schedule: train.micro_batches, train.schedule")
    plan.add_argument("--recompute", metavar="LIST", help=f"activation recomputation: {', '.join(RECOMPUTE_MODES)}")
    plan.add_argument("--attention", metavar="LIST",
                      help=f"{', '.join(BACKENDS)} (naive keeps the s x s scores, the others do not)")
    plan.add_argument("--fp32-attention", action="store_true", default=None,
                      help="attention core in fp32 under a low-precision policy (train.fp32_attention)")


def _add_plan_costs(plan: argparse.ArgumentParser) -> None:
    """What it runs on and costs, serving, comparisons and what is printed."""
    plan.add_argument("--hardware", metavar="LIST", default="this",
                      help="this (measure this machine) or one of: a100, h100-sxm, h100-pcie, h200, b200, l4, "
                           "rtx4090, mi300x")
    plan.add_argument("--mfu", type=number(float, above=0, at_most=1), default=0.5,
                      help="MFU assumed for the time estimate, and for prefill with --inference (default 0.5)")
    plan.add_argument("--scaling", metavar="FIT.json", help="a fit of lmforge scaling fit: add the final loss "
                                                          "it predicts for this model and --tokens")
    plan.add_argument("--tokens", type=number(float, above=0),
                      help="token budget for the total time, FLOPs and cost (default: Chinchilla's 20 tokens per "
                           "parameter)")
    plan.add_argument("--price-per-hour", type=number(float, at_least=0),
                      help="price of one device-hour, for the cost of the budget")
    plan.add_argument("--reserve", type=number(float, at_least=0), default=2.0, metavar="GIB",
                      help="GiB per device kept free for the CUDA context and allocator fragmentation (default 2)")
    plan.add_argument("--inference", action="store_true",
                      help="plan serving instead of training: weights, KV cache, prefill, decode, largest batch")
    plan.add_argument("--weights", metavar="LIST", help="--inference: fp32, bf16 (default), fp16, int8 or int4")
    plan.add_argument("--group-size", type=COUNT, help="--inference: weights per int8/int4 scale (default 128)")
    plan.add_argument("--kv-dtype", metavar="LIST", help="--inference: KV cache in fp32, bf16 (default), fp16, "
                                                         "fp8 or int8")
    plan.add_argument("--compare", action="store_true",
                      help="plan every combination of the LIST options given, as one table (and one --plot)")
    plan.add_argument("--solve", choices=("batch", "devices"),
                      help="find the largest micro-batch that fits, or the fewest devices (dp x tp x pp; "
                           "--inference: tp) that fit")
    plan.add_argument("--lora-rank", type=COUNT, help="LoRA fine-tuning at this rank: count the trainable adapters "
                                                    "and the gradient and optimizer bytes saved")
    plan.add_argument("--lora-targets", help="linear layers LoRA wraps, comma-separated name patterns "
                                             "(default q_proj,k_proj,v_proj,o_proj)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--plot", metavar="PNG", type=picture, help="save a bar chart of the memory breakdown")
    plan.add_argument("--roofline", metavar="PNG", type=picture,
                      help="save the roofline: the machine's roof and each operation "
                           "class of the step as a point (FLOP/byte against FLOP/s)")
    plan.add_argument("--dtypes", action="store_true", help="print the table of floating-point formats and exit")
    plan.add_argument("--remeasure", action="store_true",
                      help="with --hardware this: measure the matmul peak and memory bandwidth again")
