"""Hugging Face model folders in and out: the llama family as `LlamaForCausalLM`, gpt as `GPT2LMHeadModel`.

A Hugging Face folder holds config.json (architecture and shapes), model.safetensors (weights by
HF's names; a large model shards it, listed in model.safetensors.index.json) and its tokenizer:
tokenizer.json, the `tokenizers` format lmforge saves its own tokenizer in, with
tokenizer_config.json naming the special tokens. lmforge reads and writes these files itself;
transformers is needed only to check the result (tests/test_interop.py loads what it writes).

The two models correspond module for module, renamed (`LAYOUTS`), with two differences in GPT-2:
  - its linear layers are `Conv1D`, which stores the weight as (in, out), the transpose of
    nn.Linear's (out, in);
  - it fuses the query, key and value projections into one `c_attn` of width 3d (q, k, v in that
    order), which lmforge keeps as three linears.
Rotary layout: lmforge rotates the pairs (x_j, x_{j+d/2}) ("rotate half", model/transformer.py),
the layout of HF Llama checkpoints (HF's conversion script permutes the rows of Meta's
interleaved-pair q and k weights into it), so q_proj and k_proj are copied unpermuted; the tests
show it by the logits, which a wrong layout would change from the first position on. Both
families' GELU is GPT-2's tanh approximation ("gelu_new").
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from lmforge.accounting.shapes import meta_model
from lmforge.config import ROPE_SCALING_KEYS, Config, ModelConfig, validate
from lmforge.data.tokenizer import END_OF_TEXT
from lmforge.common.errors import LmforgeError


@dataclass(frozen=True)
class Layout:
    """Where a family's modules live in its HF model."""
    architecture: str  # config.json "architectures"
    model_type: str
    top: dict[str, str]  # lmforge module outside the blocks -> HF module
    layer: str  # HF prefix of block i
    block: dict[str, str]  # lmforge module inside a block -> HF module
    fused: dict[str, tuple[str, ...]]  # HF module -> the lmforge modules concatenated into it, in order
    conv1d: bool  # the block's linear weights are stored (in, out)


LAYOUTS = {
    "llama": Layout(
        "LlamaForCausalLM", "llama",
        top={"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"},
        layer="model.layers.{}",
        block={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               **{f"attn.{p}": f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{f"mlp.{p}": f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}},
        fused={}, conv1d=False),
    "gpt": Layout(
        "GPT2LMHeadModel", "gpt2",
        top={"tok_embeddings": "transformer.wte", "pos_embeddings": "transformer.wpe", "norm": "transformer.ln_f",
             "lm_head": "lm_head"},
        layer="transformer.h.{}",
        block={"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.o_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc",
               "mlp.down_proj": "mlp.c_proj"},
        fused={"attn.c_attn": ("attn.q_proj", "attn.k_proj", "attn.v_proj")}, conv1d=True),
}
ARCHITECTURES = {layout.architecture: family for family, layout in LAYOUTS.items()}
# buffers some checkpoints hold besides weights: older GPT-2's causal mask, older Llama's rotary
# frequencies (lmforge computes its own from config.json)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# -- names ---------------------------------------------------------------------------------------------

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


def expected_state(cfg: ModelConfig) -> dict[str, torch.Size]:
    """lmforge's tensor names and shapes for `cfg` (the model built on the meta device)."""
    return {name: t.shape for name, t in meta_model(cfg).state_dict().items()}


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Stop with one line if `state` does not hold exactly the tensors of lmforge's model for `cfg`
    (the tied LM head may be left out)."""
    expected = expected_state(cfg)
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


# -- config.json ---------------------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, end_id: int, dtype: torch.dtype) -> dict:
    """config.json for `cfg`. The end-of-text token serves as BOS and EOS (lmforge adds no BOS)."""
    common = {"architectures": [LAYOUTS[cfg.family].architecture], "model_type": LAYOUTS[cfg.family].model_type,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "bos_token_id": end_id, "eos_token_id": end_id, "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.family == "gpt":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_positions": cfg.max_seq_len, "n_inner": cfg.ffn_dim, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout, "scale_attn_weights": True}
    return {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            # the keys of Llama 3.x's released config.json, which transformers 4 and 5 both read
            "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": cfg.dropout}


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """lmforge's ModelConfig for an HF config.json; one line for what lmforge cannot represent."""
    arch = (config.get("architectures") or [None])[0] or config.get("model_type")
    family = ARCHITECTURES.get(arch) or {"llama": "llama", "gpt2": "gpt"}.get(arch)
    if family is None:
        raise LmforgeError(f"{where}: architecture {arch} is not supported; lmforge reads "
                           f"{' and '.join(ARCHITECTURES)}")

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise LmforgeError(f"{where}: {what}, which lmforge's {family} family does not have")

    if family == "gpt":
        require(config.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                f"activation_function {config.get('activation_function')}")
        require(config.get("scale_attn_weights", True), "attention scores not scaled by 1/sqrt(d)")
        require(not config.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx")
        model = ModelConfig(family="gpt", vocab_size=config["vocab_size"], d_model=config["n_embd"],
                            n_layers=config["n_layer"], n_heads=config["n_head"], d_ff=config.get("n_inner"),
                            max_seq_len=config["n_positions"], norm_eps=config.get("layer_norm_epsilon", 1e-5),
                            tie_embeddings=config.get("tie_word_embeddings", True))
    else:
        heads = config["num_attention_heads"]
        require(config.get("hidden_act", "silu") == "silu", f"hidden_act {config.get('hidden_act')}")
        require(not config.get("attention_bias") and not config.get("mlp_bias"), "biases")
        require(config.get("head_dim") in (None, config["hidden_size"] // heads),
                f"head_dim {config.get('head_dim')} != hidden_size / num_attention_heads")
        theta, scaling = _rope(config, where)
        model = ModelConfig(family="llama", vocab_size=config["vocab_size"], d_model=config["hidden_size"],
                            n_layers=config["num_hidden_layers"], n_heads=heads,
                            n_kv_heads=config.get("num_key_value_heads"), d_ff=config["intermediate_size"],
                            max_seq_len=config["max_position_embeddings"], rope_theta=theta,
                            rope_scaling=scaling, norm_eps=config.get("rms_norm_eps", 1e-6),
                            tie_embeddings=config.get("tie_word_embeddings", False))
    try:
        validate(Config(model=model))
    except LmforgeError as err:
        raise LmforgeError(f"{where}: {err}") from None
    return model


def _rope(config: dict, where: str) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling, from transformers 5's "rope_parameters" or the older separate keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise LmforgeError(f"{where}: rope scaling of type {kind} is not supported (lmforge implements llama3)")
    return theta, {"rope_type": "llama3", **{key: params[key] for key in ROPE_SCALING_KEYS[1:]}}


# -- reading and writing folders -----------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise LmforgeError(f"{path} is unreadable ({err}): is the folder a complete Hugging Face download?") from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(_read_json(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            other = " (lmforge reads safetensors, not pytorch_model.bin)" if (folder / "pytorch_model.bin").is_file() else ""
            raise LmforgeError(f"{folder} has no {name}{other}")
        try:
            state.update(load_file(str(folder / name)))
        except SafetensorError as err:
            raise LmforgeError(f"{folder / name} is corrupt: {err}") from None
    return state


def read_hf_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise LmforgeError(f"{folder} has no tokenizer.json (lmforge needs the fast tokenizer): save one there "
                           f"with transformers' AutoTokenizer.from_pretrained(...).save_pretrained")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise LmforgeError(f"{path} is unreadable ({str(err).splitlines()[0]})") from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise LmforgeError(f"{path} has {tokenizer.get_vocab_size()} tokens, more than the model's {vocab_size}: "
                           f"the tokenizer belongs to another model")
    return tokenizer


def read_end_token(folder: Path, tokenizer: Tokenizer) -> str:
    """The token that ends a document: the first eos_token_id of generation_config.json or config.json
    (a list in instruction-tuned models), else tokenizer_config.json's eos_token."""
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            eos = _read_json(folder / name).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) and eos else eos
            if isinstance(eos, int) and tokenizer.id_to_token(eos) is not None:
                return tokenizer.id_to_token(eos)
    if (folder / "tokenizer_config.json").is_file():
        eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    raise LmforgeError(f"{folder} names no end-of-text token (eos_token_id in config.json): add it there")


def import_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """An HF Llama or GPT-2 folder as lmforge's config, state dict (lmforge's names, the file's dtype)
    and tokenizer. The end-of-text token is `read_end_token(folder, tokenizer)`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise LmforgeError(f"{folder} is not a Hugging Face model folder (no config.json)")
    cfg = model_config_from_hf(_read_json(folder / "config.json"), where=str(folder))
    tokenizer = read_hf_tokenizer(folder, cfg.vocab_size)
    state = from_hf_state(cfg, read_hf_weights(folder), where=str(folder))
    return cfg, state, tokenizer


def export_hf(model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer: Tokenizer,
              out_dir: str | Path, family: str | None = None, end_token: str = END_OF_TEXT) -> None:
    """Write an HF folder that transformers' Auto classes load: config.json, generation_config.json,
    model.safetensors and the tokenizer as a PreTrainedTokenizerFast. `out_dir` is written into as
    given (interop/folders.py stages it). `family` defaults to, and must equal, model_cfg.family."""
    if family is not None and family != model_cfg.family:
        raise LmforgeError(f"cannot export a {model_cfg.family} model as the {family} family")
    check_state(model_cfg, state_dict, where="the model to export")
    end_id = tokenizer.token_to_id(end_token)
    if end_id is None:
        raise LmforgeError(f"the tokenizer has no {end_token} token to end documents with (data.end_token)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = state_dict["tok_embeddings.weight"].dtype
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg, end_id, dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": end_id, "eos_token_id": end_id}) + "\n")
    # transformers refuses a safetensors file whose metadata does not say which framework wrote it
    save_file(to_hf_state(model_cfg, state_dict), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end_token, "eos_token": end_token,
                        "model_max_length": model_cfg.max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
