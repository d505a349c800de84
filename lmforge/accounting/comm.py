"""Bytes each rank sends per optimizer step, for each data-parallel strategy (train.parallel).

Rajbhandari et al. 2020 ("ZeRO", section 7): data parallelism all-reduces the gradients, 2 Psi
elements per rank per step (a reduce-scatter and an all-gather); ZeRO stages 1 and 2 do the same
two halves separately (reduce-scatter the gradients, all-gather the updated parameters), 2 Psi;
stage 3 all-gathers the parameters twice (forward and backward) and reduce-scatters the
gradients, 3 Psi. Those are the limits for many ranks: a ring sends (N-1)/N of a tensor per pass
per rank, and we count that factor, because it is what each rank really sends (1/N of the data is
its own) and because parallel/comm.py counts the collectives the engines call the same way, so
the two can be compared exactly at N = 2 or 3 (where the factor is 1/2 or 2/3, not 1).

What this implementation moves besides the paper's idealisation, counted here too:
- ZeRO shards per unit (each block, and "rest": embeddings, final norm, head; parallel/zero.py),
  each padded to a multiple of N: Psi_padded = sum over units of ceil(numel / N) N.
- ZeRO-3 gathers "rest" once for forward and backward together (the head's backward follows its
  forward at once), so 2 Psi_blocks + Psi_rest parameter elements, not 2 Psi; and it gathers in
  every accumulation micro-step, so that many times per step.
- Gradients travel in the working dtype: 16-bit under the mixed policies for ZeRO (the paper's
  layout), the parameters' dtype for DDP (fp32 under bf16-mixed: autocast keeps fp32 weights).
A step also reduces a few scalars (loss, gradient norm, found-inf): `step_collectives` counts
those calls beside the model's; their bytes are not in these figures.
FSDP2 moves what ZeRO-3 does, up to its own padding (each parameter's dim 0, not each unit).
Under tensor parallelism a replica's rank holds and reduces only its tensor rank's parameters
(shapes.py's tensor_rank_unit_sizes); the tensor ranks' own activations traffic is
`tensor_parallel_communication`.
"""

import math

import torch.nn as nn

from lmforge.accounting.shapes import model_shapes, tensor_parallel_dim, tensor_parallel_slices
from lmforge.config import ModelConfig
from lmforge.model.transformer import meta_model
from lmforge.modes import POLICIES, Policy, get_recompute, get_strategy, shard_unit
from lmforge.optim.muon import is_hidden_matrix


def unit_sizes(cfg: ModelConfig, lora: tuple[int, str] | None = None,
               trainable_only: bool = True) -> dict[str, int]:
    """Parameters per ZeRO unit ("rest", "blocks.0", ...), tied tensors once (read with the model's
    other shapes from its one meta build). With `lora` = (rank, targets) the base is frozen
    (model/lora.py): only the adapters train, and `trainable_only` keeps just them (what ZeRO shards
    and DDP reduces; frozen weights stay whole on every rank)."""
    if lora is None:
        return dict(model_shapes(cfg).unit_sizes)
    from lmforge.model.lora import apply_lora

    sizes: dict[str, int] = {}
    for name, p in apply_lora(meta_model(cfg), lora[1], lora[0]).named_parameters():
        if p.requires_grad or not trainable_only:
            sizes[shard_unit(name)] = sizes.get(shard_unit(name), 0) + p.numel()
    return sizes


def element_bytes(strategy: str, policy: Policy) -> int:
    """Bytes of each gradient and parameter element the collectives of `strategy` move."""
    if get_strategy(strategy).zero_stage >= 1 and policy.autocast:
        return policy.bytes.compute  # 16-bit working weights and gradients
    return policy.bytes.gradient


def step_communication(cfg: ModelConfig, strategy: str, dp: int, policy: Policy = POLICIES["fp32"],
                       grad_accum: int = 1, lora: tuple[int, str] | None = None, tp: int = 1,
                       optimizer: str = "adamw", replicate: int = 1) -> dict:
    """Per rank per step: `ring_elements` (sum of S over the collectives, S in elements, twice for
    an all-reduce), `sent_bytes` = (N-1)/N of it in bytes, and the paper's figure `paper_elements`
    (2 Psi or 3 Psi, the N -> infinity limit, no padding). Gradients are reduced once per step
    (accumulation micro-steps do not communicate); ZeRO-3 gathers parameters in every micro-step.
    With `lora` = (rank, targets) Psi is the adapters' count: only their gradients cross, and our
    ZeRO keeps frozen weights whole; FSDP2 shards (so gathers) the frozen base too. With `tp`, Psi
    is one tensor rank's share (LoRA's adapters: not split yet, parallel/world.py refuses them).
    With `replicate` > 1 (hybrid sharding, FSDP2 over a (replicate, dp) mesh) `dp` is the shard
    group's size, and each reduce-scattered gradient shard is then all-reduced over the replicate
    group (Zhao et al. 2023, section 3.2.2): part "replicate", included in `sent_bytes`."""
    stage = get_strategy(strategy).zero_stage
    sizes = unit_sizes(cfg, lora) if tp == 1 or lora is not None else model_shapes(cfg).tensor_rank_unit_sizes(tp)
    psi = sum(sizes.values())
    padded = {u: -(-n // dp) * dp for u, n in sizes.items()}
    if strategy == "none" or dp == 1:
        by_op, paper = {}, 0
    elif strategy == "ddp":
        by_op, paper = {"all_reduce": 2 * psi}, 2 * psi  # one all-reduce of every gradient
    elif stage in (1, 2):
        by_op, paper = {"reduce_scatter": sum(padded.values()), "all_gather": sum(padded.values())}, 2 * psi
    else:  # zero3, fsdp: gather for forward and for backward ("rest" once), reduce-scatter
        held = sizes if strategy != "fsdp" or lora is None else unit_sizes(cfg, lora, trainable_only=False)
        gathered = {u: -(-n // dp) * dp for u, n in held.items()}
        gathers = sum((2 if u != "rest" else 1) * n for u, n in gathered.items())
        by_op = {"all_gather": grad_accum * gathers, "reduce_scatter": sum(padded.values())}
        paper = 2 * sum(held.values()) + psi
    sent = communication(strategy, dp, element_bytes(strategy, policy), sum(by_op.values()), paper)
    sent["ring_elements_by_op"] = by_op  # the model's collectives' share, by operator
    if replicate > 1:  # the gradient shard this rank holds (padded units / dp), all-reduced
        shard = sum(padded.values()) // dp
        sent["replicate"] = communication("ddp", replicate, sent["element_bytes"], 2 * shard, 2 * psi / dp)
        sent["sent_bytes"] += sent["replicate"]["sent_bytes"]
    blocks = [n for u, n in sizes.items() if u != "rest"]
    return with_optimizer_gather(sent, blocks, strategy, dp, policy, lora is not None, optimizer)


def step_collectives(cfg: ModelConfig, strategy: str, dp: int, policy: Policy = POLICIES["fp32"],
                     grad_accum: int = 1, bucket_mb: float = 25.0) -> dict[str, int]:
    """Calls per rank per step of each collective the engines make (parallel/comm.py's counts), by
    operator: "all_reduce", "reduce_scatter", "all_gather" of the gradients and parameters (kind
    "model": their bytes are step_communication's), and "scalar_all_reduce", the few numbers every
    step reduces (kind "scalar"). DDP all-reduces one bucket of about `bucket_mb` MiB at a time,
    filled in the order backward produces the gradients (parallel/ddp.py); ZeRO moves each unit
    once a step (ZeRO-3: gathered for forward and again for backward, "rest" once, each
    micro-batch). The scalars: the step's target count (engine.loss_divisors), its loss averaged
    for the log (mean_across_ranks), the squared gradient norm summed where gradients are sharded
    (ZeRO, FSDP), and fp16's found-inf. FSDP2's own collectives are counted as ZeRO-3's."""
    stage = get_strategy(strategy).zero_stage
    if strategy == "none" or dp == 1:
        return {}
    units = unit_sizes(cfg)
    if strategy == "ddp":
        buckets, size = 0, 0
        limit = bucket_mb * 2**20
        for shape in reversed(model_shapes(cfg).parameter_shapes):
            nbytes = math.prod(shape) * policy.bytes.parameter
            if size and size + nbytes > limit:
                buckets, size = buckets + 1, 0
            size += nbytes
        calls = {"all_reduce": buckets + (size > 0)}
    elif stage in (1, 2):
        calls = {"reduce_scatter": len(units), "all_gather": len(units)}
    else:
        calls = {"all_gather": grad_accum * sum(2 if u != "rest" else 1 for u in units), "reduce_scatter": len(units)}
    calls["scalar_all_reduce"] = 2 + (stage >= 1) + policy.loss_scaling
    return calls


def with_optimizer_gather(sent: dict, block_units: list[int], strategy: str, dp: int, policy: Policy,
                          lora: bool, optimizer: str) -> dict:
    """`sent` plus what the optimizer itself gathers (kind "optimizer" in parallel/comm.py): Muon
    under ZeRO all-gathers each unit that holds a Muon matrix (the blocks, of `block_units`
    elements; none with LoRA, whose adapters are AdamW's) at its padded size in the master dtype,
    once per step (parallel/whole_matrices.py); nothing for other optimizers and strategies (DDP
    keeps whole matrices; FSDP is refused with Muon). `policy` as given or as ZeRO lays it out."""
    gathered = 0
    if optimizer == "muon" and get_strategy(strategy).zero_stage in (1, 2, 3) and strategy != "fsdp" \
            and dp > 1 and not lora:
        gathered = sum(-(-n // dp) * dp for n in block_units)
    size = policy.bytes.master or policy.bytes.parameter  # ZeRO's master shards (fp32 under the mixed policies)
    extra = gathered * size * (dp - 1) / dp
    return {**sent, "optimizer_ring_elements": gathered, "optimizer_sent_bytes": extra,
            "sent_bytes": sent["sent_bytes"] + extra}


def communication(strategy: str, dp: int, size: int, ring: float, paper: float) -> dict:
    """The count of one rank's collectives per step, JSON-ready: `ring` elements of `size` bytes,
    of which a ring of dp ranks sends (dp-1)/dp, beside the paper's `paper` elements."""
    return {"strategy": strategy, "ranks": dp, "element_bytes": size, "ring_elements": ring,
            "sent_bytes": ring * size * (dp - 1) / dp, "paper_elements": paper, "paper_bytes": paper * size}


def tensor_parallel_communication(cfg: ModelConfig, b: int, s: int, tp: int, sequence_parallel: bool,
                                  policy: Policy = POLICIES["fp32"], grad_accum: int = 1,
                                  optimizer: str = "adamw", stage: tuple[int, bool, bool] | None = None,
                                  recompute: str = "none", lora: tuple[int, str] | None = None) -> dict:
    """What one of tp tensor ranks sends per step (parallel/tp_ops.py's collectives, kind "tp"),
    by part, for grad_accum micro-batches of b sequences of s tokens. S is one micro-batch's
    residual stream, b*s*d elements: the regions' inputs in the residual dtype, the row-parallel
    outputs in the matmuls' (Shoeybi et al. 2019, section 3; Korthikanti et al. 2022, section 4.2.2):

      without sequence parallelism  per region g's all-reduce forward, f's backward: 2 x 2S
                                    the embedding's g 2S, the head's f (backward) 2S
      with it                       per region all-gather + reduce-scatter forward; backward the
                                    exit's all-gather, the entry's reduce-scatter and the input's
                                    re-gather (tp_ops.linear_on_gathered): 5S
                                    the embedding's reduce-scatter and its all-gather back 2S,
                                    the head's all-gather, re-gather and reduce-scatter 3S
      recomputed blocks             (train.recompute=full) each block's forward runs again in
                                    backward as far as the last tensor backward needs (torch's
                                    non-reentrant checkpoint stops there: the MLP's down
                                    projection and its exit are not rerun): + 2S per block
                                    without sequence parallelism (the attention's g); with it
                                    + 3S, both entries' all-gathers and the attention's
                                    reduce-scatter (derived, not measured: pipelines refuse it)
      LoRA adapters                 (`lora`: rank, targets) `_lora_parts`; without sequence
                                    parallelism only (with it: not counted)
      the vocabulary-parallel loss  3 all-reduces of one fp32 number per token (max, sum of
                                    exponentials, target logit: parallel/tp_ops.py)
      the parameters' parts         `_parameter_parts`

    Ring bytes count S per all-gather or reduce-scatter and 2S per all-reduce (parallel/comm.py);
    a ring of tp ranks sends (tp-1)/tp of them. `stage`: (layers, first, last) of one pipeline
    stage's tensor rank (accounting/plan/pipeline.py): its blocks' parts, the embedding's only on
    the first stage, the head's and the loss's only on the last; default the whole model."""
    p = policy.bytes
    if tp == 1:
        return {"ring_bytes": {}, "sent_bytes": 0.0}
    layers, first, last = stage or (cfg.n_layers, True, True)
    entry, exit_ = b * s * cfg.d_model * p.residual, b * s * cfg.d_model * p.compute
    regions = 2 * layers  # attention and MLP of every block
    if sequence_parallel:
        parts = {"embedding": 2 * entry, "layers": regions * (3 * entry + 2 * exit_), "head": 3 * entry}
    else:
        parts = {"embedding": 2 * entry, "layers": regions * 2 * (entry + exit_), "head": 2 * entry}
    parts["loss"] = 3 * 2 * b * s * 4
    if get_recompute(recompute).blocks:
        parts["recomputed_layers"] = layers * (2 * exit_ if not sequence_parallel else 2 * entry + exit_)
    if lora is not None and not sequence_parallel:
        parts.update(_lora_parts(cfg, b * s, p.compute, entry, lora, (layers, first, last),
                                 get_recompute(recompute).blocks))
    parts = {part: n for part, n in parts.items()
             if "layers" in part or part.startswith("lora") or (first if part == "embedding" else last)}
    parts.update(_parameter_parts(cfg, tp, sequence_parallel, policy, (layers, first, last)))
    ring = {part: grad_accum * n for part, n in parts.items()}
    if optimizer == "muon" and not lora:
        ring["optimizer"] = sum(param.numel() * tp // tensor_parallel_slices(name, cfg, tp) * p.gradient
                                for name, param in meta_model(cfg).named_parameters()
                                if tensor_parallel_dim(name) is not None and is_hidden_matrix(name, param.shape))
    return {"ring_bytes": ring, "sent_bytes": sum(ring.values()) * (tp - 1) / tp}


def _parameter_parts(cfg: ModelConfig, tp: int, sequence_parallel: bool, policy: Policy,
                     stage: tuple[int, bool, bool]) -> dict:
    """tensor_parallel_communication's parts that follow the parameters (ring bytes per micro-batch):

      gradient sums     an all-reduce of each whole parameter a rank uses on its share only: QK-norm
                        gains (its heads); with sequence parallelism every whole one (norms,
                        row-parallel biases: its tokens)
      KV copies         with fewer KV heads than ranks, each k and v projection's gradient
                        all-reduced in n_kv_heads slots, zeros but this rank's head (parallel/tp.py's
                        sum_over_copies): the whole projection's elements, n_kv_heads x one head
      fp8 amax          fp8: each split linear of the blocks all-reduces (max) the amax of the two
                        operands it holds a slice of, one fp32 number each (parallel/tp_fp8.py):
                        2 x 2 x 4 bytes per linear

    And once a step, not per micro-batch (the caller's): Muon's optimizer part, each split block
    matrix's update all-gathered whole for Newton-Schulz (parallel/tp_engine.py's
    TensorParallelMatrices), tp x the slice in the gradient's dtype; none with LoRA (the adapters
    are AdamW's)."""
    gradient, held = policy.bytes.gradient, lambda name: _held_by_stage(name, *stage)
    params = list(meta_model(cfg).named_parameters())
    summed = sum(param.numel() for name, param in params
                 if tensor_parallel_dim(name) is None and (sequence_parallel or "_norm." in name and ".attn." in name)
                 and held(name))
    parts = {"gradient_sums": 2 * summed * gradient}
    if tp > cfg.kv_heads:
        copied = sum(param.numel() for name, param in params
                     if tensor_parallel_dim(name) is not None and tensor_parallel_slices(name, cfg, tp) < tp
                     and held(name))
        parts["kv_copies"] = 2 * copied * gradient
    if policy.fp8:
        linears = sum(type(m) is nn.Linear for name, m in meta_model(cfg).named_modules()
                      if name.startswith("blocks.") and held(name))
        parts["fp8_amax"] = linears * 2 * 2 * 4
    return parts


def _lora_parts(cfg: ModelConfig, tokens: int, compute_bytes: int, entry: float, lora: tuple[int, str],
                stage: tuple, recomputed: bool = False) -> dict:
    """tensor_parallel_communication's LoRA parts (ring bytes per micro-batch) for a stage
    (parallel/tp_lora.py): each column-parallel target's whole A has its fp32 gradient all-reduced,
    each row-parallel one's A x (r per token) leaves through g: 2S' each; and the first region of
    the model takes no input gradient (the embedding is frozen): - 2S there. Recomputed
    blocks rerun each row-parallel adapter's g: B's gradient needs its output, so recomputation runs
    as far as it, and for an adapter on the MLP's exit (down_proj) through that exit's own g too
    (2S more: without the adapter the rerun stops before it)."""
    from lmforge.model.lora import apply_lora  # here, as lora.lora_parameters: torch when first asked

    rank, targets = lora
    parts = {"lora_gradient_sums": 0, "lora_row_parallel": 0, "lora_recomputed": 0}
    for name, param in apply_lora(meta_model(cfg), targets, rank).named_parameters():
        layer, leaf = name.rsplit(".", 1)
        if leaf != "lora_A" or not _held_by_stage(name, *stage):
            continue
        if tensor_parallel_dim(f"{layer}.weight") == 0:  # column-parallel: the whole A's gradient, fp32
            parts["lora_gradient_sums"] += 2 * param.numel() * 4
        else:  # row-parallel: A_r x_r summed over the ranks
            parts["lora_row_parallel"] += 2 * tokens * rank * compute_bytes
            if recomputed:
                exit_rerun = 2 * tokens * cfg.d_model * compute_bytes if layer.endswith("down_proj") else 0
                parts["lora_recomputed"] += 2 * tokens * rank * compute_bytes + exit_rerun
    if stage[1]:  # the model's first region: nothing before it trains, so f's backward is not run
        parts["lora_frozen_input"] = -2 * entry
    return parts


def _held_by_stage(name: str, layers: int, first: bool, last: bool) -> bool:
    """Whether a stage of `layers` blocks (the blocks are alike: counted as blocks 0 .. layers - 1)
    at that place holds the parameter `name` (accounting/pipeline.py's stage_of_parameter)."""
    top = name.split(".")[0]
    if top == "blocks":
        return int(name.split(".")[1]) < layers
    return first if top in ("tok_embeddings", "pos_embeddings") else last
