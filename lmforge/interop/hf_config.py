"""config.json of a Hugging Face model folder to and from lmforge's ModelConfig, and the one way the
folder's JSON files are read. GPT-2's GELU is the tanh approximation ("gelu_new"). Llama, Mistral,
Qwen2 and Qwen3 are one family here: their config.json files differ only in the keys that say
which of lmforge's build-time choices (q/k/v biases, QK-norm, a sliding window, the head width)
they make."""

import json
from pathlib import Path

import torch

from lmforge.common.errors import LmforgeError
from lmforge.config import FAMILY_MLPS, ROPE_SCALING_KEYS, Config, ModelConfig, validate
from lmforge.interop.hf_names import ARCHITECTURES, MODEL_TYPES


# config.json's numbers, by the type lmforge reads them as (bool is no number here)
HF_INTS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "hidden_size", "intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim",
           "sliding_window", "max_window_layers")
HF_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon")
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx")
HF_REQUIRED = {"gpt": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
               "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "max_position_embeddings")}


def read_json(path: Path) -> dict:
    """One JSON object file of a Hugging Face folder; one line if it is missing, damaged or no object."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LmforgeError(f"{path} is unreadable ({err}): is the folder a complete Hugging Face download?") from None
    if not isinstance(value, dict):
        raise LmforgeError(f"{path} holds a JSON {type(value).__name__}, expected an object of settings")
    return value


def check_hf_fields(config: dict, family: str, where: str) -> None:
    """config.json's fields lmforge reads, present and of their type, or one line naming the first
    that is not (a missing count would be a KeyError, a string one a TypeError, 2.5 layers cut to 2)."""
    for key in HF_REQUIRED[family]:
        if config.get(key) is None:
            raise LmforgeError(f"{where}/config.json has no {key} (expected an integer)")
    for keys, kinds, what in ((HF_INTS, int, "an integer"), (HF_FLOATS, (int, float), "a number"),
                              (HF_BOOLS, bool, "true or false")):
        for key in keys:
            value = config.get(key)
            if value is None and (key not in config or keys is not HF_FLOATS):
                continue  # a null count or switch is its default (GPT-2's n_inner, head_dim); a null theta is none
            if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
                raise LmforgeError(f"{where}/config.json: {key} is {value!r}, expected {what}")
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise LmforgeError(f"{where}/config.json: {key} is {config[key]!r}, expected an object")


def read_model_config(folder: Path) -> ModelConfig:
    """lmforge's ModelConfig for the HF model in `folder`, from its config.json."""
    if not (folder / "config.json").is_file():
        raise LmforgeError(f"{folder} is not a Hugging Face model folder (no config.json)")
    return model_config_from_hf(read_json(folder / "config.json"), where=str(folder))


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF architecture that holds `cfg`'s build-time choices: Qwen3 has QK-norm, Qwen2 q/k/v
    biases, Mistral a sliding window, Llama none of them (the plainest that fits is written).
    A recipe switch that changes the function computed (docs/recipe.md) has no counterpart there:
    refused, not dropped (the exported model would compute something else)."""
    _refuse_recipe_switches(cfg)
    if cfg.family == "gpt":
        return "GPT2LMHeadModel"
    if cfg.qk_norm and cfg.qkv_bias:
        raise LmforgeError("no Hugging Face architecture has both model.qk_norm and model.qkv_bias (Qwen3's "
                           "attention_bias biases the output projection too): this model cannot be exported")
    return ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias
            else "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM")


def _refuse_recipe_switches(cfg: ModelConfig) -> None:
    arch = "GPT2LMHeadModel" if cfg.family == "gpt" else "LlamaForCausalLM and its kin"
    if cfg.mlp_kind != FAMILY_MLPS[cfg.family]:
        raise LmforgeError(f"model.mlp={cfg.mlp} cannot be exported to Hugging Face: {arch} build a "
                           f"{FAMILY_MLPS[cfg.family]} MLP, and dropping it would change what the model computes")
    if cfg.logit_softcap is not None:
        raise LmforgeError(f"model.logit_softcap={cfg.logit_softcap:g} cannot be exported to Hugging Face: {arch} "
                           f"have no logit soft-capping, and dropping it would change what the model computes")


def hf_config(cfg: ModelConfig, end_id: int, dtype: torch.dtype) -> dict:
    """config.json for `cfg`. The end-of-text token serves as BOS and EOS (lmforge adds no BOS)."""
    arch = hf_architecture(cfg)
    common = {"architectures": [arch], "model_type": ARCHITECTURES[arch][1],
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "bos_token_id": end_id, "eos_token_id": end_id, "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.family == "gpt":
        return {**common, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_positions": cfg.max_seq_len, "n_inner": cfg.ffn_dim, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout, "scale_attn_weights": True}
    llama = {**common, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_dim,
             "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
             "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
             "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
             # the keys of Llama 3.x's released config.json, which transformers 4 and 5 both read
             "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "attention_dropout": cfg.dropout}
    if arch == "LlamaForCausalLM":
        return {**llama, "attention_bias": False, "mlp_bias": False}
    if arch == "MistralForCausalLM":
        return {**llama, "sliding_window": cfg.sliding_window}
    # Qwen2 and Qwen3 put the window on layers from max_window_layers on: 0 puts it on every layer
    window = cfg.sliding_window
    qwen = {**llama, "use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0,
            "layer_types": [("sliding_attention" if window else "full_attention")] * cfg.n_layers}
    return {**qwen, "attention_bias": False} if arch == "Qwen3ForCausalLM" else qwen


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """lmforge's ModelConfig for an HF config.json; one line for what lmforge cannot represent."""
    archs = config.get("architectures")
    arch = (archs[0] if isinstance(archs, list) and archs else None) or config.get("model_type")
    arch = MODEL_TYPES.get(arch, arch) if isinstance(arch, str) else None
    if arch not in ARCHITECTURES:
        raise LmforgeError(f"{where}: architecture {arch} is not supported; lmforge reads "
                           f"{', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[arch][0]
    check_hf_fields(config, family, where)
    config = {key: value for key, value in config.items() if value is not None}  # null: the default, as absent

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise LmforgeError(f"{where}: {what}, which lmforge's {family} family does not have")

    model = _gpt_config(config, require) if family == "gpt" else _llama_config(arch, config, require, where)
    try:
        validate(Config(model=model))
    except LmforgeError as err:
        raise LmforgeError(f"{where}: {err}") from None
    return model


def _gpt_config(config: dict, require) -> ModelConfig:
    require(config.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function {config.get('activation_function')}")
    require(config.get("scale_attn_weights", True), "attention scores not scaled by 1/sqrt(d)")
    require(not config.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx")
    return ModelConfig(family="gpt", vocab_size=config["vocab_size"], d_model=config["n_embd"],
                       n_layers=config["n_layer"], n_heads=config["n_head"], d_ff=config.get("n_inner"),
                       max_seq_len=config["n_positions"], norm_eps=config.get("layer_norm_epsilon", 1e-5),
                       tie_embeddings=config.get("tie_word_embeddings", True))


def _llama_config(arch: str, config: dict, require, where: str) -> ModelConfig:
    """Llama, Mistral, Qwen2 and Qwen3: the llama family with the choices `arch` makes."""
    heads, width = config["num_attention_heads"], config["hidden_size"]
    require(config.get("hidden_act", "silu") == "silu", f"hidden_act {config.get('hidden_act')}")
    require(not config.get("attention_bias") and not config.get("mlp_bias"),
            "biases on every attention projection or in the MLP")
    theta, scaling = _rope(config, where)
    head_dim = config.get("head_dim") or width // heads
    window = config.get("sliding_window") if arch == "MistralForCausalLM" else _qwen_window(config, require)
    return ModelConfig(family="llama", vocab_size=config["vocab_size"], d_model=width,
                       n_layers=config["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=config.get("num_key_value_heads"), d_ff=config["intermediate_size"],
                       max_seq_len=config["max_position_embeddings"], rope_theta=theta,
                       rope_scaling=scaling, norm_eps=config.get("rms_norm_eps", 1e-6),
                       tie_embeddings=config.get("tie_word_embeddings", False),
                       d_head=None if head_dim * heads == width else head_dim,
                       qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window)


def _qwen_window(config: dict, require) -> int | None:
    """Qwen2/3's window: on the layers from max_window_layers on, when use_sliding_window (Llama: none)."""
    if not config.get("use_sliding_window"):
        return None
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["sliding_attention" if i >= config.get("max_window_layers", 28)
                                          else "full_attention" for i in range(layers)]
    require(len(set(kinds)) == 1, "a sliding window on some layers only (layer_types / max_window_layers)")
    return config.get("sliding_window") if kinds[0] == "sliding_attention" else None


def _rope(config: dict, where: str) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling, from transformers 5's "rope_parameters" or the older separate keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise LmforgeError(f"{where}/config.json: rope_theta is {theta!r}, expected a number")
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise LmforgeError(f"{where}: rope scaling of type {kind} is not supported (lmforge implements llama3)")
    missing = [key for key in ROPE_SCALING_KEYS[1:] if not isinstance(params.get(key), (int, float))]
    if missing:
        raise LmforgeError(f"{where}/config.json: llama3 rope scaling without a number for {missing[0]}")
    return theta, {"rope_type": "llama3", **{key: params[key] for key in ROPE_SCALING_KEYS[1:]}}
