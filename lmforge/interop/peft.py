"""LoRA adapters in PEFT's layout, so that `peft.PeftModel.from_pretrained` puts them on the exported base.

An adapter folder holds adapter_config.json (rank r, alpha, the targeted modules) and
adapter_model.safetensors with two tensors per adapted linear layer, named by the HF model's
module path:
    base_model.model.<hf module>.lora_A.weight   (r, in)
    base_model.model.<hf module>.lora_B.weight   (out, r)
The layer computes W x + (alpha / r) B A x (Hu et al. 2021), as lmforge's LoRA does; lmforge names
the same tensors `<lmforge module>.lora_A` / `.lora_B` (`blocks.0.attn.q_proj.lora_A`), and the
module paths map through interop/hf_names.py's `hf_module` / `lmforge_modules`.

GPT-2 fuses q, k and v into one `c_attn` (interop/hf_names.py), so three lmforge adapters become one:
  - with one A shared by q, k and v (what reading a PEFT adapter of c_attn gives), c_attn gets
    that A and B = [B_q; B_k; B_v], rank r;
  - otherwise A = [A_q; A_k; A_v] and B = blockdiag(B_q, B_k, B_v): rank 3r, written as
    PEFT's `rank_pattern` with alpha 3 alpha in `alpha_pattern`, so its scale stays alpha / r.
Reading undoes either exactly, so write -> read and read -> write round-trip bit for bit.
GPT-2's adapted layers are Conv1D: the adapter's tensors keep nn.Linear's layout there too, and
`fan_in_fan_out` tells PEFT so.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.common.errors import LmforgeError
from lmforge.config import ModelConfig
from lmforge.interop.hf_names import LAYOUTS, hf_module, lmforge_modules
from lmforge.model.lora import adapter_state_dict, apply_lora, has_lora, load_adapter_state_dict
from lmforge.model.transformer import meta_model
from lmforge.parallel.tp_lora import adapter_slices

PREFIX = "base_model.model."


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear layer of lmforge's model for `cfg`, by module path."""
    return {name: tuple(module.weight.shape) for name, module in meta_model(cfg).named_modules()
            if isinstance(module, torch.nn.Linear)}


def lora_target(module: str) -> str:
    """"blocks.3.attn.q_proj" -> "attn.q_proj" (what a target names: the same layer in every block)."""
    return module.split(".", 2)[2] if module.startswith("blocks.") else module


def _adapted_modules(adapter_state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)}, each checked against the model's linear layers and the rank."""
    shapes = linear_shapes(cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter_state.items():
        module, _, kind = name.rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise LmforgeError(f"{where}: {name} is not a LoRA tensor (<module>.lora_A or .lora_B)")
        pairs.setdefault(module, {})[kind] = tensor
    out = {}
    for module, pair in pairs.items():
        if module not in shapes:
            raise LmforgeError(f"{where} adapts {module}, which is not a linear layer of this "
                               f"{cfg.family} model: it is an adapter for another base model")
        if set(pair) != {"lora_A", "lora_B"}:
            raise LmforgeError(f"{where}: {module} has {', '.join(pair)} but not both lora_A and lora_B")
        (out_features, in_features), a, b = shapes[module], pair["lora_A"], pair["lora_B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LmforgeError(f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)} where this "
                               f"model needs {(rank, in_features)} and {(out_features, rank)} for rank {rank}: "
                               f"it is an adapter for another base model")
        out[module] = (a, b)
    return out


def write_peft_adapter(adapter_state: dict[str, torch.Tensor], model_cfg: ModelConfig, rank: int, alpha: float,
                       targets, out_dir: str | Path, dropout: float = 0.0) -> None:
    """Write `adapter_state` (lmforge names) as a PEFT LoRA adapter folder. `targets` names the adapted
    layers as their module path inside a block ("attn.q_proj") or its last part ("q_proj")."""
    adapted = _adapted_modules(adapter_state, model_cfg, rank, where="the adapter to write")
    wanted = {lora_target(module) for module in adapted}
    named = {t for t in wanted if any(t == target or t.endswith("." + target) for target in targets)}
    if named != wanted or not wanted:
        raise LmforgeError(f"the adapter holds layers {', '.join(sorted(wanted)) or 'none'}, not the targets "
                           f"{', '.join(targets)}")
    family = model_cfg.family
    if family == "gpt" and "lm_head" in wanted:
        raise LmforgeError("a GPT-2 adapter cannot include lm_head: PEFT takes one fan_in_fan_out for all "
                           "layers, and GPT-2's head is an nn.Linear among Conv1D layers")
    # the HF modules adapted, each with the (A, B) of the lmforge modules it holds (three for GPT-2's c_attn)
    groups = {hf: [adapted.get(module) for module in lmforge_modules(family, hf)]
              for hf in sorted({hf_module(family, module)[0] for module in adapted})}
    if any(pair is None for pairs in groups.values() for pair in pairs):
        raise LmforgeError(f"GPT-2 fuses q, k and v into one c_attn: adapt q_proj, k_proj and v_proj "
                           f"together or none of them (targets {', '.join(targets)})")
    # one decision for all layers, so that PEFT's rank_pattern can name c_attn once
    shared = all(torch.equal(a, pairs[0][0]) for pairs in groups.values() if len(pairs) > 1 for a, _ in pairs)
    tensors, pattern = {}, {}
    for hf, pairs in groups.items():
        if len(pairs) == 1:
            (a, b), = pairs
        elif shared:
            a, b = pairs[0][0], torch.cat([b for _, b in pairs])
        else:
            a, b = torch.cat([a for a, _ in pairs]), torch.block_diag(*[b for _, b in pairs])
            pattern = {"attn.c_attn": 3}
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = b.contiguous()
    layout = LAYOUTS[family]
    block_prefix = layout.layer.split("{}")[0]  # "model.layers." -> a target is the path after the index
    hf_targets = sorted({hf.removeprefix(block_prefix).split(".", 1)[-1] if hf.startswith(block_prefix) else hf
                         for hf in groups})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "bias": "none",
        # a path's suffix names the same layer in every block (GPT-2 has two c_proj: attn. and mlp.)
        "target_modules": hf_targets, "fan_in_fan_out": layout.conv1d,
        "rank_pattern": {key: times * rank for key, times in pattern.items()},
        "alpha_pattern": {key: times * alpha for key, times in pattern.items()},
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def read_peft_adapter(folder: str | Path,
                      model_cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], int, float, list[str]]:
    """A PEFT LoRA adapter folder as (adapter state by lmforge name, rank, alpha, targets), checked
    against lmforge's model for `model_cfg`; one line for anything lmforge's LoRA cannot hold."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        stored = load_file(str(folder / "adapter_model.safetensors"))
    except FileNotFoundError as err:
        raise LmforgeError(f"{folder} is not a PEFT adapter folder: {Path(err.filename).name} is missing") from None
    except (OSError, json.JSONDecodeError, SafetensorError) as err:
        raise LmforgeError(f"{folder} is not a readable PEFT adapter ({err})") from None
    where = f"{folder}/adapter_config.json"
    if not isinstance(config, dict) or "r" not in config:
        raise LmforgeError(f"{where} is not a PEFT LoRA config: a JSON object with the rank r was expected")
    patterns = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not all(isinstance(p, dict) for p in patterns) or not isinstance(config.get("lora_dropout") or 0, (int, float)):
        raise LmforgeError(f"{where}: rank_pattern and alpha_pattern must be objects and lora_dropout a number")
    if config.get("peft_type") != "LORA":
        raise LmforgeError(f"{folder} is a {config.get('peft_type')} adapter; lmforge reads LoRA adapters")
    unsupported = [key for key in ("use_dora", "use_rslora", "modules_to_save") if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']}")
    if unsupported:
        raise LmforgeError(f"{folder} uses {', '.join(unsupported)}, which lmforge's LoRA does not have")
    rank, alpha = config["r"], config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LmforgeError(f"{where} has r {rank!r} and lora_alpha {alpha!r}: both must be "
                           f"positive numbers")
    ranks, alphas = patterns
    fused_rank = ranks.get("attn.c_attn", ranks.get("c_attn", rank))
    if set(ranks) - {"attn.c_attn", "c_attn"} or set(alphas) - {"attn.c_attn", "c_attn"} \
            or fused_rank not in (rank, 3 * rank) or fused_rank == 3 * rank and not (
                alphas.get("attn.c_attn", alphas.get("c_attn")) == 3 * alpha):
        raise LmforgeError(f"{folder} gives layers their own ranks or alphas (rank_pattern {ranks}, alpha_pattern "
                           f"{alphas}); lmforge's LoRA has one rank and alpha")
    state: dict[str, torch.Tensor] = {}
    for key, tensor in stored.items():
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise LmforgeError(f"{folder} holds {key}, which is not a LoRA weight of a linear layer")
        hf, kind = key[len(PREFIX):].removesuffix(".weight").rsplit(".", 1)
        try:
            modules = lmforge_modules(model_cfg.family, hf)
        except KeyError:
            raise LmforgeError(f"{folder} adapts {hf}, which lmforge's {model_cfg.family} model has no "
                               f"counterpart for: it is an adapter for another base model") from None
        if len(modules) == 1:
            state[f"{modules[0]}.{kind}"] = tensor
        else:
            partner = f"{PREFIX}{hf}.{'lora_B' if kind == 'lora_A' else 'lora_A'}.weight"
            if partner not in stored:
                raise LmforgeError(f"{folder}: {hf} has {kind} but not its partner")
            state.update(_split_fused(modules, kind, tensor, stored[partner], rank, where=f"{folder}: {hf}"))
    adapted = _adapted_modules(state, model_cfg, rank, where=str(folder))
    return state, rank, alpha, sorted({lora_target(module) for module in adapted})


def _split_fused(modules: tuple[str, ...], kind: str, tensor: torch.Tensor, other: torch.Tensor, rank: int,
                 where: str) -> dict[str, torch.Tensor]:
    """The q, k and v parts of one of c_attn's tensors (`other` is its partner A or B)."""
    a, b = (tensor, other) if kind == "lora_A" else (other, tensor)
    n = len(modules)
    if a.shape[0] == rank:  # one A shared by the parts, B stacked
        return {f"{m}.{kind}": (a.clone() if kind == "lora_A" else part.contiguous())
                for m, part in zip(modules, b.chunk(n))}
    if a.shape[0] != n * rank:
        raise LmforgeError(f"{where} has rank {a.shape[0]}, neither the adapter's rank {rank} nor {n} x {rank}")
    blocks = [row.chunk(n, dim=1) for row in b.chunk(n)]
    if any(blocks[i][j].any() for i in range(n) for j in range(n) if i != j):
        raise LmforgeError(f"{where} of rank {n} x {rank} does not split into q, k and v adapters of rank {rank} "
                           f"(its B is not block-diagonal)")
    parts = a.chunk(n) if kind == "lora_A" else [blocks[i][i] for i in range(n)]
    return {f"{m}.{kind}": part.contiguous() for m, part in zip(modules, parts)}


def apply_peft_adapter(model: torch.nn.Module, folder: str | Path, model_cfg: ModelConfig) -> None:
    """Put the PEFT LoRA adapter in `folder` on `model` (lmforge's model for `model_cfg`, in place):
    its targeted layers wrapped in LoRALinear with the adapter's rank, alpha and weights."""
    if has_lora(model):
        raise LmforgeError(f"the model already has LoRA adapters (a LoRA run): give --merge to fold them in "
                           f"before adding {folder}")
    state, rank, alpha, targets = read_peft_adapter(folder, model_cfg)
    apply_lora(model, targets, rank, alpha)
    load_adapter_state_dict(model, state, origin=str(folder))


def peft_settings(folder: str | Path, model_cfg: ModelConfig) -> dict:
    """A PEFT adapter's LoRA settings as lmforge's finetune section names them (read and checked
    against the base: `finetune --adapter` continues training it)."""
    _, rank, alpha, targets = read_peft_adapter(folder, model_cfg)
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    return {"lora_rank": rank, "lora_alpha": float(alpha), "lora_targets": ",".join(targets),
            "lora_dropout": float(config.get("lora_dropout") or 0.0)}


def load_peft_weights(model: torch.nn.Module, folder: str | Path, model_cfg: ModelConfig) -> None:
    """Copy the PEFT adapter's weights into `model`'s LoRA layers (applied with its settings); a
    pipeline stage takes the layers it holds, a tensor-parallel rank its slices of them."""
    state, _, _, _ = read_peft_adapter(folder, model_cfg)
    held = adapter_state_dict(model)
    if len(held) < len(state):  # a pipeline stage (train/setup.py cuts the model before LoRA)
        state = {name: value for name, value in state.items() if name in held}
    state = adapter_slices(model, state)  # a tensor-parallel rank's split layers hold slices (parallel/tp_lora.py)
    load_adapter_state_dict(model, state, origin=str(folder))
