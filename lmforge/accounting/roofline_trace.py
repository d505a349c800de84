"""What one training step really dispatches: every aten operator of a forward, backward, clip and
optimizer step of the model, recorded with a TorchDispatchMode while the model runs on fake
tensors (torch._subclasses.FakeTensorMode: CPU shapes, dtypes and strides, no data, no compute),
so the operators are those eager CPU runs and their bytes are the tensors' real sizes, at any
model size, in a second or so.

Each record: the operator's name, the phase it ran in (step: forward and backward; optimizer:
clipping and the update), its tensor inputs and outputs as (shape, stride, dtype), and the
innermost module that ran it (torch.utils.module_tracker, forward and backward). roofline_ops.py
turns the records into the roofline's operations. This is the model's own code, pieces below
accounting only (model, precision, wrap, optim): the same pieces train/setup.py's build_model and
parallel/engine.py's step put together for one process.
"""

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from lmforge.config import Config, ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.modes.precision import get_policy
from lmforge.optim.build import make_optimizer, param_groups
from lmforge.optim.clip import clip_grad_norm
from lmforge.precision.policy import autocast, prepare_model
from lmforge.wrap.chunked_loss import apply_chunked_loss
from lmforge.wrap.recompute import apply_recompute


@dataclass(frozen=True)
class Record:
    op: str  # the aten operator, e.g. "mm"
    phase: str  # "step" (forward and backward) or "optimizer" (clipping and the update)
    module: str  # the innermost module running it, "" for none
    inputs: tuple  # ((shape, stride, dtype name), ...) of every tensor argument, lists flattened
    outputs: tuple
    is_view: bool  # the output aliases an input: no bytes move
    calls: int = 1  # kernels on CPU: a foreach op loops over its list, one kernel per tensor


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch.")


# no kernel: a Python-side tensor made from a constant, the scalar read of a counter
_BOOKKEEPING = ("aten::lift_fresh", "aten::_local_scalar_dense")


class _Recorder(TorchDispatchMode):
    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker, self.phase, self.records = tracker, "step", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten" or func._schema.name in _BOOKKEEPING:
            return out
        inputs = tuple(_meta(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        outputs = tuple(_meta(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        parents = [p for p in self.tracker.parents if p != "Global"]
        module = max(parents, key=lambda p: p.count(".")) if parents else ""
        view = func.is_view or func._schema.name in ("aten::_unsafe_view", "aten::detach")
        name = func._schema.name.removeprefix("aten::")
        calls = len(args[0]) if name.startswith("_foreach") else 1
        self.records.append(Record(name, self.phase, module, inputs, outputs, bool(view), calls))
        return out


def trace_step(cfg: ModelConfig, batch: int, seq_len: int, precision: str = "fp32", recompute: str = "none",
               optimizer: str = "adamw", loss_chunk_tokens: int = 0, clip: bool = True, fp32_attention: bool = False) -> tuple[Record, ...]:
    """The aten operators of one micro-batch's forward + backward and one clip + optimizer step
    (the second step's: AdamW's moments exist by then, as in every step of a run but the first),
    cached by its arguments (a ModelConfig is not hashable: by its repr)."""
    key = (repr(cfg), batch, seq_len, precision, recompute, optimizer, loss_chunk_tokens, clip, fp32_attention)
    if key not in _TRACES:
        _TRACES[key] = record_step(cfg, *key[1:])
    return _TRACES[key]


_TRACES: dict = {}


def record_step(cfg: ModelConfig, batch: int, seq_len: int, precision: str = "fp32", recompute: str = "none",
                optimizer: str = "adamw", loss_chunk_tokens: int = 0, clip: bool = True,
                fp32_attention: bool = False, fake: bool = True) -> tuple[Record, ...]:
    """trace_step's records, uncached; `fake=False` runs the step on real tensors (what the
    tests compare the fake run with)."""
    policy = get_policy(precision)
    # a plan may ask for a longer sequence than the config's context (the accounting allows it)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))
    full = Config(model=cfg)
    full.optim.name = optimizer
    fake = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with fake:
        model = Transformer(cfg)
        prepare_model(model, policy, fp32_attention=fp32_attention)
        apply_recompute(model, recompute)
        apply_chunked_loss(model, loss_chunk_tokens)
        tokens = torch.zeros(batch, seq_len + 1, dtype=torch.long)
    # built outside the fake mode: the optimizer's step counters are real tensors (AdamW reads
    # them: stack, unique, item), its moments fake ones, made like the parameters they follow
    opt = make_optimizer(full, policy, param_groups(full, model))
    # bf16-pure's count of updates rounded away reads each step's count back (.item()), which a fake
    # tensor cannot: the trace leaves it out (a copy and a compare per parameter, not predicted)
    if getattr(opt, "count_lost_updates", False):
        opt.count_lost_updates = False
    device = torch.device("cpu")

    def one_step(recorder=None):
        # the recorder entered after (above) the fake mode: it sees the operators the step calls,
        # not those the fake mode runs to work out their shapes (decompositions and meta kernels,
        # run on a miss of its cache only, so a trace below it would depend on what ran before)
        recording = recorder if recorder is not None else contextlib.nullcontext()
        with fake, recording:
            with autocast(policy, device):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        if recorder:
            recorder.phase = "optimizer"
        with recording:
            if clip:
                clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    one_step()  # the first step creates the optimizer's state
    tracker = ModuleTracker()
    recorder = _Recorder(tracker)
    with tracker:
        one_step(recorder)
    return tuple(recorder.records)


def recorded(fn) -> tuple[Record, ...]:
    """The aten operators `fn()` dispatches, recorded as trace_step records them (phase "step")."""
    tracker = ModuleTracker()
    with tracker, _Recorder(tracker) as recorder:
        fn()
    return tuple(recorder.records)


def dispatched_calls(fn) -> int:
    """How many aten operators `fn()` dispatches, counted as trace_step counts them."""
    return len(recorded(fn))
