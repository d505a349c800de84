"""What one training step really dispatches: every aten operator of a forward, backward, clip and
optimizer step of the model, recorded with a TorchDispatchMode while the model runs on fake
tensors (torch._subclasses.FakeTensorMode: CPU shapes, dtypes and strides, no data, no compute),
so the operators are those eager CPU runs and their bytes are the tensors' real sizes, at any
model size, in a second or so.

Each record: the operator's name, the phase it ran in (step: forward and backward; optimizer:
clipping and the update), its tensor inputs and outputs as (shape, stride, dtype), and the
innermost module that ran it (_Modules below, forward and backward). roofline/ops.py
turns the records into the roofline's operations. This is the model's own code, pieces below
accounting only (model, precision, wrap, optim): the same pieces train/setup.py's build_model and
parallel/engine.py's step put together for one process.
"""

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from lmforge.config import Config, ModelConfig
from lmforge.modes import get_policy
from lmforge.precision.policy import LossScaler, autocast


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


class _Modules:
    """The modules running now, innermost last, in forward and in backward (a module's backward
    runs from the gradients of its outputs to those of its inputs: grad hooks on them), named by
    their path from the first module seen ("Transformer.blocks.0.attn").

    A list, not torch.utils.module_tracker.ModuleTracker's set: HeadLoss calls the model's norm
    and head, which are not its children, so a set holds "Transformer.loss" and "Transformer.norm"
    equally deep and cannot say which is inner. Picking from it went by the set's iteration
    order, which follows the process's string hash seed and the set's history (a deeper model
    adds and removes more names before the head): the final norm's operators were loss in one
    process and norms/elementwise in another, and a 5-layer trace disagreed with layer_extrapolated's
    2- and 3-layer ones (tests/test_roofline.py)."""

    def __init__(self):
        self.running: list[str] = []
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles, self._reset_queued = [], False

    def innermost(self) -> str:
        return self.running[-1] if self.running else ""

    def _name(self, module) -> str:
        if module not in self._names:  # a root: it and all it holds named from its class
            for name, sub in module.named_modules(prefix=type(module).__name__):
                self._names[sub] = name
        return self._names[module]

    def _grad_hook(self, tensors, fn) -> None:
        tensors = [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._handles.append(register_multi_grad_hook(tensors, lambda *_: fn()))

    def _pre(self, module, args) -> None:
        name = self._name(module)
        self.running.append(name)
        self._grad_hook(args, lambda: self._leave(name))  # its backward ends at its inputs' gradients

    def _post(self, module, args, output) -> None:
        name = self._name(module)
        self._leave(name)
        # its backward starts at its outputs' gradients; an input handed back (a dropout of p=0)
        # has no backward of its own (its gradient would enter the module after leaving it)
        inputs = tree_flatten(args)[0]
        made = [t for t in tree_flatten(output)[0] if not any(t is a for a in inputs)]
        self._grad_hook(made, lambda: self._enter_backward(name))

    def _leave(self, name: str) -> None:
        if name in self.running:  # its latest entry (a module may run inside itself)
            del self.running[len(self.running) - 1 - self.running[::-1].index(name)]

    def _enter_backward(self, name: str) -> None:
        if not self._reset_queued:  # modules whose inputs need no gradient (the embedding) never leave
            torch.autograd.Variable._execution_engine.queue_callback(self._reset)
            self._reset_queued = True
        self.running.append(name)

    def _reset(self) -> None:
        self.running, self._reset_queued = [], False

    def __enter__(self):
        self._hooks = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for handle in self._hooks + self._handles:
            handle.remove()
        self._handles = []


class _Recorder(TorchDispatchMode):
    def __init__(self, modules: _Modules):
        super().__init__()
        self.modules, self.phase, self.records = modules, "step", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace != "aten" or func._schema.name in _BOOKKEEPING:
            return out
        inputs = tuple(_meta(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        outputs = tuple(_meta(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        view = func.is_view or func._schema.name in ("aten::_unsafe_view", "aten::detach")
        name = func._schema.name.removeprefix("aten::")
        calls = len(args[0]) if name.startswith("_foreach") else 1
        self.records.append(Record(name, self.phase, self.modules.innermost(), inputs, outputs, bool(view), calls))
        return out


def trace_step(build, cfg: ModelConfig, batch: int, seq_len: int, precision: str = "fp32", recompute: str = "none",
               optimizer: str = "adamw", loss_chunk_tokens: int = 0,
               fp32_attention: bool = False) -> tuple[Record, ...]:
    """The aten operators of one micro-batch's forward + backward and one clip + optimizer step
    (the second step's: AdamW's moments exist by then, as in every step of a run but the first),
    cached by its arguments (a ModelConfig is not hashable: by its repr). `build(cfg: Config)` is
    the trainer's own one-process engine (model and optimizer as train/setup.py builds and wraps
    them), handed down by the caller: accounting imports no training code."""
    key = (build, repr(cfg), batch, seq_len, precision, recompute, optimizer, loss_chunk_tokens, fp32_attention)
    if key not in _TRACES:
        _TRACES[key] = record_step(build, cfg, *key[2:])
    return _TRACES[key]


_TRACES: dict = {}


def record_step(build, cfg: ModelConfig, batch: int, seq_len: int, precision: str = "fp32", recompute: str = "none",
                optimizer: str = "adamw", loss_chunk_tokens: int = 0, fp32_attention: bool = False,
                fake: bool = True) -> tuple[Record, ...]:
    """trace_step's records, uncached; `fake=False` runs the step on real tensors (what the
    tests compare the fake run with)."""
    policy = get_policy(precision)
    # a plan may ask for a longer sequence than the config's context (the accounting allows it)
    full = Config(model=dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len)))
    full.optim.name, full.train.precision, full.train.recompute = optimizer, precision, recompute
    full.train.loss_chunk_tokens, full.train.fp32_attention = loss_chunk_tokens, fp32_attention
    fake = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with fake:  # the optimizer makes its state in its first step, outside: its step counters real tensors
        engine = build(full)
        tokens = torch.zeros(batch, seq_len + 1, dtype=torch.long)
    # bf16-pure's count of updates rounded away reads each step's count back (.item()), which a fake
    # tensor cannot: the trace leaves it out (a copy and a compare per parameter, not predicted)
    if getattr(engine.optimizer, "count_lost_updates", False):
        engine.optimizer.count_lost_updates = False
    no_scaling = LossScaler(enabled=False)

    def one_step(recorder=None):
        # the recorder entered after (above) the fake mode: it sees the operators the step calls,
        # not those the fake mode runs to work out their shapes (decompositions and meta kernels,
        # run on a miss of its cache only, so a trace below it would depend on what ran before)
        recording = recorder if recorder is not None else contextlib.nullcontext()
        with fake, recording:
            with autocast(policy, torch.device("cpu")):
                loss = engine.model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        if recorder:
            recorder.phase = "optimizer"
        with recording:  # the engine's own clip and step
            engine.unscale_and_clip(no_scaling, 1.0)
            engine.step()
            engine.zero_grad()

    one_step()  # the first step creates the optimizer's state
    modules = _Modules()
    recorder = _Recorder(modules)
    with modules:
        one_step(recorder)
    return tuple(recorder.records)


def recorded(fn) -> tuple[Record, ...]:
    """The aten operators `fn()` dispatches, recorded as trace_step records them (phase "step")."""
    modules = _Modules()
    with modules, _Recorder(modules) as recorder:
        fn()
    return tuple(recorder.records)


def dispatched_calls(fn) -> int:
    """How many aten operators `fn()` dispatches, counted as trace_step counts them."""
    return len(recorded(fn))
