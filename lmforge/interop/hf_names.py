"""lmforge's parameter names and layouts against Hugging Face's, for the llama family as
`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM` (one layout:
the same module names, with biases or q/k norms where the config's choices build them) and gpt
as `GPT2LMHeadModel`.

The two models correspond module for module, renamed (`LAYOUTS`), with two differences in GPT-2:
  - its linear layers are `Conv1D`, which stores the weight as (in, out), the transpose of
    nn.Linear's (out, in);
  - it fuses the query, key and value projections into one `c_attn` of width 3d (q, k, v in that
    order), which lmforge keeps as three linears.
Rotary layout: lmforge rotates the pairs (x_j, x_{j+d/2}) ("rotate half", model/attention.py),
the layout of HF Llama checkpoints (HF's conversion script permutes the rows of Meta's
interleaved-pair q and k weights into it), so q_proj and k_proj are copied unpermuted; the tests
show it by the logits, which a wrong layout would change from the first position on.
"""

from dataclasses import dataclass

import torch

from lmforge.common.errors import LmforgeError
from lmforge.config import ModelConfig
from lmforge.model.transformer import meta_model


@dataclass(frozen=True)
class Layout:
    """Where a family's modules live in its HF model."""
    top: dict[str, str]  # lmforge module outside the blocks -> HF module
    layer: str  # HF prefix of block i
    block: dict[str, str]  # lmforge module inside a block -> HF module
    fused: dict[str, tuple[str, ...]]  # HF module -> the lmforge modules concatenated into it, in order
    conv1d: bool  # the block's linear weights are stored (in, out)


LAYOUTS = {
    "llama": Layout(
        top={"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
        layer="model.layers.{}",
        block={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               **{f"attn.{p}": f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
               **{f"mlp.{p}": f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}},
        fused={}, conv1d=False),
    "gpt": Layout(
        top={"tok_embeddings": "transformer.wte", "pos_embeddings": "transformer.wpe", "norm": "transformer.ln_f",
             "lm_head": "lm_head"},
        layer="transformer.h.{}",
        block={"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.o_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc",
               "mlp.down_proj": "mlp.c_proj"},
        fused={"attn.c_attn": ("attn.q_proj", "attn.k_proj", "attn.v_proj")}, conv1d=True),
}
# The HF architectures, config.json "architectures" -> (lmforge family, "model_type"): the llama
# family's four share its layout above, each with its own build-time choices (hf_config.py reads and
# writes them).
ARCHITECTURES = {"LlamaForCausalLM": ("llama", "llama"), "MistralForCausalLM": ("llama", "mistral"),
                 "Qwen2ForCausalLM": ("llama", "qwen2"), "Qwen3ForCausalLM": ("llama", "qwen3"),
                 "GPT2LMHeadModel": ("gpt", "gpt2")}
MODEL_TYPES = {model_type: arch for arch, (_, model_type) in ARCHITECTURES.items()}
# buffers some checkpoints hold besides weights: older GPT-2's causal mask, older Llama's rotary
# frequencies (lmforge computes its own from config.json)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def hf_module(family: str, module: str) -> tuple[str, int | None]:
    """The HF module holding lmforge `module` ("blocks.3.attn.q_proj"), and which of its fused parts
    it is (None: all of it). Raises KeyError for a module HF has no place for."""
    layout = LAYOUTS[family]
    if not module.startswith("blocks."):
        return layout.top[module], None
    _, layer, inner = module.split(".", 2)
    prefix = layout.layer.format(layer)
    for fused, parts in layout.fused.items():
        if inner in parts:
            return f"{prefix}.{fused}", parts.index(inner)
    return f"{prefix}.{layout.block[inner]}", None


def lmforge_modules(family: str, module: str) -> tuple[str, ...]:
    """The lmforge modules stored in HF `module` (three for GPT-2's c_attn, else one). KeyError if none."""
    layout = LAYOUTS[family]
    top = {hf: ours for ours, hf in layout.top.items()}
    if module in top:
        return (top[module],)
    head, _, rest = layout.layer.partition("{}")
    if not module.startswith(head):
        raise KeyError(module)
    layer, _, inner = module[len(head):].partition(rest or ".")
    if not layer.isdigit():
        raise KeyError(module)
    block = {hf: ours for ours, hf in layout.block.items()}
    inner_ours = layout.fused.get(inner) or (block[inner],)
    return tuple(f"blocks.{layer}.{ours}" for ours in inner_ours)


def is_conv1d_weight(family: str, module: str, kind: str) -> bool:
    """Whether lmforge `module`'s `kind` tensor is stored transposed in HF (GPT-2's Conv1D)."""
    return LAYOUTS[family].conv1d and kind == "weight" and module.startswith("blocks.") and module.endswith("_proj")


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Stop with one line if `state` does not hold exactly the tensors of lmforge's model for `cfg`
    (the tied LM head may be left out)."""
    expected = {name: t.shape for name, t in meta_model(cfg).state_dict().items()}  # built on the meta device
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    missing = [name for name in expected if name not in state]
    extra = [name for name in state if name not in expected and not (cfg.tie_embeddings and name == "lm_head.weight")]
    if missing or extra:
        problem = f"lacks {', '.join(missing[:3])}" if missing else f"holds {', '.join(extra[:3])}, which it should not"
        raise LmforgeError(f"{where} {problem}: its weights do not fit its config.json")
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise LmforgeError(f"{where}: {name} has shape {tuple(state[name].shape)} where its config "
                               f"needs {tuple(shape)}")


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lmforge's tensors under HF's names and layouts (a tied LM head stored once, as HF does)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        module, kind = name.rsplit(".", 1)
        if module == "lm_head" and cfg.tie_embeddings:
            continue
        hf, part = hf_module(cfg.family, module)
        if is_conv1d_weight(cfg.family, module, kind):
            tensor = tensor.t()
        if part is None:
            out[f"{hf}.{kind}"] = tensor.contiguous()
        else:
            fused.setdefault(f"{hf}.{kind}", {})[part] = tensor
    for key, parts in fused.items():  # q, k, v side by side along the output dimension, the last
        out[key] = torch.cat([parts[i] for i in sorted(parts)], dim=-1).contiguous()
    return out


def from_hf_state(cfg: ModelConfig, hf_state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """HF's tensors under lmforge's names and layouts; a tied LM head appears under both of its
    names, so that `Transformer(cfg).load_state_dict(state)` takes it as is."""
    out: dict[str, torch.Tensor] = {}
    prefix = LAYOUTS[cfg.family].layer.split(".")[0] + "."
    for key, tensor in hf_state.items():
        if key.endswith(IGNORED_SUFFIXES):
            continue
        if cfg.family == "gpt" and not key.startswith((prefix, "lm_head.")):
            key = prefix + key  # GPT-2's original files name the base model's tensors without "transformer."
        hf, kind = key.rsplit(".", 1)
        try:
            modules = lmforge_modules(cfg.family, hf)
        except KeyError:
            raise LmforgeError(f"{where} holds {key}, which lmforge's {cfg.family} model has no place for") from None
        parts = tensor.chunk(len(modules), dim=-1) if len(modules) > 1 else (tensor,)
        for module, part in zip(modules, parts):
            if is_conv1d_weight(cfg.family, module, kind):
                part = part.t()
            out[f"{module}.{kind}"] = part.contiguous()
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)  # some tied checkpoints store the head again: one copy is used
    check_state(cfg, out, where)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["tok_embeddings.weight"]
    return out
