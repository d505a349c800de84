"""The plan's pipeline section: every stage of a setup with pp > 1 counted on its own, from the
formulas of accounting/pipeline.py (the split, the bubble, micro-batches in flight, what each
stage holds) and accounting/memory.py.

pipeline_plan's dict, JSON-ready: stages, micro_batches, schedule, split (layers per stage),
split_source ("given", "balanced" or "interleaved": p x v equal chunks, `split` then layers per
virtual stage), virtual_stages (v, chunks per rank), bubble_fraction ((p-1)/(vm+p-1)), slowest_stage,
seconds_per_step ((m+(p-1)/v) x the slowest stage's seconds per micro-batch), ideal_seconds_per_step
(the same FLOPs spread evenly over every device, no bubble), best_mfu (assumed MFU x ideal / real:
what the schedule leaves), largest_stage (the one with the most memory: the plan's per-device
memory), and stages_detail, one dict per stage:

  stage, layers ([first, last] layer index), chunk_layers ([first, last] of each of its chunks;
  interleaved, a rank's chunks are not contiguous), parameter_count (held, the tied copy included),
  breakdown_bytes (the plan's memory parts for this stage: parameters, gradients, master_weights,
  optimizer_states, weight_copies and activations of the micro-batches in flight, a fully
  recomputed layer, the logits on the last stage), total_bytes (their sum),
  activations_per_micro_batch_bytes (saved for backward by one micro-batch's forward, weight casts
  included: what measure_saved_bytes sees), activation_breakdown_bytes (that by part, less the
  casts), micro_batches_in_flight, activations_in_flight_bytes (their product: the peak alive at
  once; interleaved, chunks_in_flight / v micro-batches' worth, the chunks taken as saving equal
  bytes), chunks_in_flight, forward_flops_per_token, seconds_per_micro_batch (forward + backward),
  sent_bytes_per_step (by what: activations forward, their gradients backward, the tied matrix's
  gradient between the end stages, the data-parallel all-reduce of the stage's gradients, the
  tensor-parallel collectives of one tensor rank of the stage). With tp > 1 every figure is one
  tensor rank's: its slices of the split matrices, the norm gains and other whole tensors whole.
"""

from lmforge.accounting import comm, memory
from lmforge.accounting.activations import activation_breakdown
from lmforge.accounting.pipeline import (StageParameters, bubble_fraction, chunks_in_flight, micro_batches_in_flight,
                                         rank_chunks, stage_communication, stage_costs, stage_parameters,
                                         virtual_split)
from lmforge.accounting.plan.make import Cost, lora, zero_stage
from lmforge.config import Config
from lmforge.config.schema import Degrees
from lmforge.modes import Policy


def pipeline_plan(cfg: Config, d: Degrees, policy: Policy, flops_per_second: float, mfu: float) -> dict:
    """plan["pipeline"] (see the module's docstring) for a config with pp > 1 stages on the mesh `d`
    under `policy`, each device doing `flops_per_second` (its peak at the assumed `mfu`)."""
    t = cfg.train
    p, m, v = d.pp, t.micro_batches, t.pipeline_virtual_stages
    split = virtual_split(cfg.model, p, v, t.pipeline_split, cfg.seq_len)
    details = stage_details(cfg, d, policy, split, flops_per_second)
    times = [stage["seconds_per_micro_batch"] for stage in details]
    slowest = max(range(p), key=times.__getitem__)
    step = (m + (p - 1) / v) * times[slowest]  # the fill and drain: p - 1 chunks of 1/v of a stage
    ideal = m * sum(times) / p
    return {"stages": p, "micro_batches": m, "schedule": t.schedule, "split": split, "virtual_stages": v,
            "split_source": "interleaved" if v > 1 else "given" if t.pipeline_split.strip() else "balanced",
            "bubble_fraction": bubble_fraction(p, m, v), "slowest_stage": slowest,
            "seconds_per_step": step, "ideal_seconds_per_step": ideal, "best_mfu": mfu * ideal / step,
            "largest_stage": max(range(p), key=lambda s: details[s]["total_bytes"]),
            "stages_detail": details}


def stage_details(cfg: Config, d: Degrees, policy: Policy, split: list[int], flops_per_second: float) -> list[dict]:
    """pipeline_plan's stages_detail: one dict per stage (rank) of the pipeline, `split` giving the
    layers of each virtual stage (each stage itself with one chunk per rank)."""
    t, p, b, s = cfg.train, d.pp, cfg.train.batch_size, cfg.seq_len
    details = []
    saved: dict = {}  # what one micro-batch saves, by (layers, first, last): stages repeat (80 layers, 40 stages)
    costs = stage_costs(cfg.model, s, split)
    # ZeRO-1 over each stage's replicas computes on 16-bit working weights under a mixed policy
    layout = memory.sharded_layout(policy, zero_stage(cfg))
    for stage in range(p):
        chunks = rank_chunks(split, p, stage)
        virtual = range(stage, len(split), p)  # the virtual stages of its chunks
        params = rank_parameters(cfg, d, split, stage)
        parts: dict = {}  # one micro-batch through all the stage's chunks
        for vs, layers in zip(virtual, chunks):
            shape = len(layers), vs == 0, vs == len(split) - 1
            if shape not in saved:
                saved[shape] = activation_breakdown(
                    cfg.model, b, s, layout, cfg.model.attention, t.recompute, d.tp, t.fp32_attention,
                    t.loss_chunk_tokens, cfg.parallel.sequence_parallel, layers=shape[0], first=shape[1],
                    last=shape[2])
            for key, value in saved[shape].items():
                # one recomputed layer alive at a time, whichever chunk it is in
                parts[key] = max(parts.get(key, 0), value) if key == "recomputed_layer" else parts.get(key, 0) + value
        cost = sum(costs[vs] for vs in virtual)
        details.append({"stage": stage, "layers": [chunks[0].start, chunks[-1].stop - 1],
                        "chunk_layers": [[c.start, c.stop - 1] for c in chunks],
                        "parameter_count": params.count,
                        **stage_memory(cfg, d, policy, stage, params, parts),
                        "forward_flops_per_token": cost,
                        # forward + backward, 3x the forward (shapes.py); tensor ranks share it
                        "seconds_per_micro_batch": 3 * cost * b * s / d.tp / flops_per_second,
                        "sent_bytes_per_step": stage_sends(cfg, d, layout, stage, params, sum(map(len, chunks)))})
    return details


def rank_parameters(cfg: Config, d: Degrees, split: list[int], stage: int) -> StageParameters:
    """The parameters one rank of stage `stage` holds: those of its chunks (the virtual stages
    stage, stage + p, ... of `split`), a tensor rank's slices with tp > 1."""
    f = cfg.finetune
    held = stage_parameters(cfg.model, split, f.lora_rank, f.lora_targets, d.tp)
    virtual = range(stage, len(split), d.pp)
    return StageParameters(tuple(shape for vs in virtual for shape in held[vs].shapes),
                           None if f.lora_rank is None else sum(held[vs].adapters for vs in virtual),
                           sum(held[vs].hidden_matrices for vs in virtual),
                           tuple(n for vs in virtual for n in held[vs].block_units))


def stage_memory(cfg: Config, d: Degrees, policy: Policy, stage: int, params: StageParameters, saved: dict) -> dict:
    """Bytes on one device of stage `stage` (see the module's docstring for the keys), which holds
    `params` and saves `saved` for one micro-batch (memory.activation_breakdown of its layers)."""
    t, p, last = cfg.train, d.pp, stage == d.pp - 1
    states = memory.model_state_bytes(cfg.model, policy, cfg.optim.name, zero_stage(cfg), d.dp, d.tp,
                                      params.adapters, params.shapes, hidden_matrices=params.hidden_matrices)
    # alive one at a time, not per micro-batch in flight: a block rerun in backward, the logits
    recomputed = saved.pop("recomputed_layer", 0)
    in_flight = micro_batches_in_flight(t.schedule, p, t.micro_batches, stage, t.pipeline_virtual_stages)
    per_micro_batch = sum(saved.values())  # weight casts included: each forward keeps its own
    breakdown = {**states,
                 "weight_copies": saved["weight_copies"] * in_flight,
                 "activations": (per_micro_batch - saved["weight_copies"]) * in_flight + recomputed,
                 "logits": memory.logits_bytes(cfg.model, t.batch_size, cfg.seq_len, policy,
                                               t.loss_chunk_tokens) / d.tp if last else 0}
    return {"breakdown_bytes": breakdown, "total_bytes": sum(breakdown.values()),
            "activation_breakdown_bytes": {k: v for k, v in saved.items() if k != "weight_copies"},
            "activations_per_micro_batch_bytes": per_micro_batch, "micro_batches_in_flight": in_flight,
            "chunks_in_flight": chunks_in_flight(t.schedule, p, t.micro_batches, stage, t.pipeline_virtual_stages),
            "activations_in_flight_bytes": per_micro_batch * in_flight}


def stage_sends(cfg: Config, d: Degrees, policy: Policy, stage: int, params: StageParameters, layers: int) -> dict:
    """Bytes one rank of stage `stage` (`layers` blocks) sends per optimizer step, by what. The
    hidden states (b, s, d) travel in the residual stream's dtype (fp32 under the autocast
    policies), whole from each tensor rank to the same tensor rank of the next stage (the regions'
    outputs are whole on every tensor rank: parallel/pipeline/engine.py; Megatron-LM's scatter and
    gather, Narayanan et al. 2021 section 4.1, would send 1/tp and all-gather it), or with sequence
    parallelism the rank's 1/tp of the sequence (Korthikanti et al. 2022: the stream is split). The
    tied matrix's two gradient copies are summed between the end stages (each sends one copy);
    the data-parallel replicas of a stage all-reduce its gradients (a ring: 2 (N-1)/N of them;
    ZeRO-1 reduce-scatters them and all-gathers the parameters: as much; Muon adds its gather).
    `policy`: as the stage runs it (memory.sharded_layout under ZeRO-1). Interleaved, a micro-batch leaves each of the
    stage's v chunks (but the model's last) and its gradient each chunk (but the first): v times
    1F1B's traffic, less one chunk on the end stages. With tp > 1, the tensor-parallel
    collectives of the stage's blocks (and of the embedding on the first, the head and loss on
    the last) for its m micro-batches: comm.tensor_parallel_communication."""
    t, p, v = cfg.train, d.pp, cfg.train.pipeline_virtual_stages
    hidden = (t.micro_batches * t.batch_size * cfg.seq_len * cfg.model.d_model * policy.bytes.residual
              / (d.tp if cfg.parallel.sequence_parallel else 1))
    tied = cfg.model.tie_embeddings and stage in (0, p - 1) and cfg.finetune.lora_rank is None
    tensor_parallel = stage_tensor_parallel(cfg, d, policy, stage, layers)
    return {"activations": hidden * (v - (stage == p - 1)),
            "activation_gradients": hidden * (v - (stage == 0)),
            "tied_embedding_gradient": cfg.model.vocab_size * cfg.model.d_model * policy.bytes.gradient / d.tp
            if tied else 0,
            "data_parallel": stage_communication(params, d.dp, policy, zero_stage(cfg), cfg.optim.name)["sent_bytes"],
            "tensor_parallel": tensor_parallel["sent_bytes"]}


def stage_tensor_parallel(cfg: Config, d: Degrees, policy: Policy, stage: int, layers: int) -> dict:
    """comm.tensor_parallel_communication for one tensor rank of stage `stage` (`layers` blocks; the
    embedding on the first stage, the head and loss on the last) over the step's m micro-batches."""
    t = cfg.train
    return comm.tensor_parallel_communication(cfg.model, t.batch_size, cfg.seq_len, d.tp,
                                              cfg.parallel.sequence_parallel, policy, t.micro_batches, cfg.optim.name,
                                              stage=(layers, stage == 0, stage == d.pp - 1),
                                              recompute=t.recompute, lora=lora(cfg))


def pipelined_cost(cfg: Config, d: Degrees, pol: Policy, peak: float, mfu: float) -> Cost:
    """Every stage counted on its own (plan/pipeline.py); a device holds the largest."""
    piped = pipeline_plan(cfg, d, pol, peak * mfu, mfu)
    largest = piped["stages_detail"][piped["largest_stage"]]
    first, held = (rank_parameters(cfg, d, piped["split"], s) for s in (0, piped["largest_stage"]))
    layout = memory.sharded_layout(pol, zero_stage(cfg))
    # rank 0's, as the trainer counts
    communication = stage_communication(first, d.dp, layout, zero_stage(cfg), cfg.optim.name)
    if d.tp > 1:
        layers = sum(map(len, rank_chunks(piped["split"], d.pp, 0)))
        communication["tensor_parallel"] = stage_tensor_parallel(cfg, d, layout, 0, layers)
    return Cost(largest["breakdown_bytes"], largest["activation_breakdown_bytes"], communication,
                piped["seconds_per_step"], piped, held.shapes)
