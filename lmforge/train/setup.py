"""One place where a training setup is built: the model for one device, then everything that wraps
it from outside, in a fixed order, then the optimizer over what is trainable.

    1. build      Transformer(cfg) on `device` (or on the meta device: shapes only, no memory),
                  with the weights of a base model when fine-tuning
    2. precision  parameter dtype, fp8 linears (module swap), fp32 attention core (wrapper module)
                  (precision/policy.py)
    3. recompute  selective: each attention core in a Recompute wrapper; full: each block
                  (train/recompute.py)
    4. LoRA       with finetune.lora_rank: freeze everything, wrap the targeted linears in
                  LoRALinear (model/lora.py)
    (data/pipeline parallelism comes here, as it arrives)
    5. optimizer  AdamW over the parameters, decay on matrices and embeddings only

The order matters: recomputation wraps what precision produced (an fp32-attention core is
recomputed as a whole, casts included), and the optimizer sees the final parameters. Each step is a
module swap or an nn.Module wrapper, visible in print(model), and refuses to run twice.

LoRA comes after precision and recomputation, not before:
  - after precision, the adapters are created after the policy has set the parameter dtype, so
    they stay fp32 (they are what trains) while a bf16-pure base is stored in bf16; fp8 swaps only
    the base linears (LoRALinear is looked into, not replaced), so the rank-r matmuls, too narrow
    to gain from fp8, stay in the autocast dtype;
  - recomputation wraps whole blocks or attention cores, which contain the linears: an adapter
    placed inside a recomputed block afterwards is recomputed with it, so nothing is lost by
    wrapping later, and names stay canonical either way (both wrappers drop their segment);
  - before data parallelism, which must see the final set of trainable parameters (it reduces
    the gradients of those alone).
"""

import torch
import torch.nn as nn

from lmforge.accounting.shapes import meta_model
from lmforge.config import Config
from lmforge.errors import LmforgeError
from lmforge.kernels import flash_triton
from lmforge.model.backends import FLASH_BACKENDS
from lmforge.model.lora import apply_lora
from lmforge.model.transformer import Transformer
from lmforge.optim.adamw import AdamW
from lmforge.precision import get_policy, prepare_model
from lmforge.train.recompute import apply_recompute


def build_model(cfg: Config, device: torch.device | str = "cpu",
                base_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The model of `cfg` on `device`, wrapped for training (steps 1-4 above). On the meta device
    nothing is allocated: parameter shapes and the module tree only, in milliseconds even for 70B.
    Elsewhere the weights are initialised on the CPU and moved, so that a seed gives the same
    initial model on every device; `base_state` (a fine-tuning base, by parameter name) replaces them."""
    if torch.device(device).type == "meta":
        model = meta_model(cfg.model)  # the accounting's own meta build: no initialisation to skip
    else:
        model = Transformer(cfg.model)
        if base_state is not None:
            model.load_state_dict(base_state)
        model.to(device)
    prepare_model(model, get_policy(cfg.train.precision), fp32_attention=cfg.train.fp32_attention,
                  fp8_scaling=cfg.train.fp8_scaling)
    apply_recompute(model, cfg.train.recompute)
    f = cfg.finetune
    if f.lora_rank is not None:
        apply_lora(model, f.lora_targets, f.lora_rank, f.lora_alpha, f.lora_dropout)
    return model


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; leave gains and biases alone (decaying a norm's gain toward
    zero only fights the normalisation). Tied tensors appear once; frozen ones not at all."""
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(cfg: Config, model: nn.Module) -> AdamW:
    o = cfg.optim
    return AdamW(weight_decay_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                 count_lost_updates=get_policy(cfg.train.precision).lossy_updates)


def build(cfg: Config, device: torch.device | str = "cpu",
          base_state: dict[str, torch.Tensor] | None = None) -> tuple[nn.Module, AdamW]:
    """Model and optimizer of a training run, built and wrapped in the documented order."""
    model = build_model(cfg, device, base_state)
    return model, build_optimizer(cfg, model)


def resolve_device(name: str, setting: str = "train.device") -> torch.device:
    """The torch device for `name` (auto, cpu, cuda, cuda:N), checked; `setting` names the option
    that gave it, for the message."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LmforgeError(f"{setting}={name} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise LmforgeError(f"{setting}={name}: lmforge runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LmforgeError(f"{setting}={name} but no CUDA device is available: use cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LmforgeError(f"{setting}={name} but this machine has {torch.cuda.device_count()} CUDA "
                               f"device(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def check_attention(model_cfg, device: torch.device) -> None:
    """What the first forward pass would refuse, refused before the run folder is written."""
    backend = model_cfg.attention
    if backend in FLASH_BACKENDS and model_cfg.dropout > 0:
        raise LmforgeError(f"model.attention={backend} does not support attention dropout "
                           f"(model.dropout={model_cfg.dropout}): set model.dropout=0 or use sdpa or naive")
    if backend == "flash_triton":
        reason = flash_triton.unavailable_reason(device)
        if reason:
            raise LmforgeError(reason)


def check_data(cfg: Config, data, warn) -> None:
    """Prepared data that cannot train this model stops here (a smaller tokenizer only warns)."""
    tokenizer_vocab = data.meta["tokenizer_vocab_size"]
    if tokenizer_vocab > cfg.model.vocab_size:
        raise LmforgeError(f"the tokenizer in {data.dir} has {tokenizer_vocab} tokens but "
                           f"model.vocab_size is {cfg.model.vocab_size}: they must match")
    if tokenizer_vocab < cfg.model.vocab_size:
        # Allowed, since padding the vocabulary (e.g. to a multiple of 64) is a real speed trick;
        # but usually the corpus was too small for the BPE trainer to learn that many tokens.
        warn(f"the tokenizer in {data.dir} has {tokenizer_vocab} tokens, "
                           f"model.vocab_size is {cfg.model.vocab_size}: the other "
                           f"{cfg.model.vocab_size - tokenizer_vocab} embedding rows are never "
                           f"used (set model.vocab_size={tokenizer_vocab} unless that padding is on purpose)")
    if len(data.val) < cfg.seq_len + 1 or len(data.train) < cfg.seq_len + 1:
        raise LmforgeError(f"the corpus is too small for windows of {cfg.seq_len} tokens "
                           f"({len(data.train)} train, {len(data.val)} val tokens): "
                           f"add text or lower train.seq_len")
