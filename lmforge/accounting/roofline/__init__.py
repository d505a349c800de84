"""A step's time from a roofline: each operation takes max(FLOPs / achieved FLOP/s at its shape,
bytes / memory bandwidth), plus the fixed cost of the kernels it launches (Williams, Waterman &
Patterson 2009, "Roofline"; the launch term is what an eager framework adds on top of it).

Pure arithmetic on a `Roof`: the machine as measured by roofline/measure.py (this machine) or as
a datasheet gives it (a named accelerator: one flat peak, no shape dependence, no launch cost).
The operations come from roofline/ops.py. How an achieved rate is read off the measured grid:
multilinear interpolation of log(rate) in log2 of each dimension, clamped at the grid's edges
(a shape larger than the grid in some dimension runs at the rate of the grid's largest there:
a matmul's rate saturates once every dimension is large).
"""

import math
from dataclasses import dataclass, field

CLASSES = ("matmuls", "attention", "norms/elementwise", "loss", "optimizer", "communication")
# bytes per element, by the trace's dtype names
ITEMSIZE = {"float64": 8, "float32": 4, "int64": 8, "int32": 4, "bfloat16": 2, "float16": 2, "bool": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Roof:
    """What the prediction needs of a machine. Grids are {dtype: [[dims..., value], ...]} on a
    regular grid: matmul (M, N, K, FLOP/s); sdpa forward and backward (T, head_dim,
    FLOP/s, counted as shapes.py counts attention: the full T x T, causal or not; backward 2x forward); elementwise
    (bytes moved by one call, bytes/s)."""
    name: str
    bandwidth: float  # bytes/s of a large copy: the memory roof
    matmul: dict
    sdpa_forward: dict
    sdpa_backward: dict
    elementwise: list  # [[bytes per call, bytes/s], ...] of the binary family (an fp32 multiply): ops of no family
    call_seconds: float = 0.0  # one eager kernel launch from Python (a tiny op's time)
    elementwise_ops: dict = field(default_factory=dict)  # {family: [[bytes per call, bytes/s], ...]}
    view_call_seconds: float | None = None  # one view (no kernel, just dispatch); None: call_seconds
    foreach_call_seconds: float = 0.0  # one tensor of a torch._foreach_* op (the C++ loop on CPU)
    # {"latency_s", "bytes_per_second"} of all-reduce, and "operators": {operator: the same} of
    # all_reduce, reduce_scatter and all_gather, if measured (under torchrun: bench/collectives.py)
    collective: dict = field(default_factory=dict)
    # the cache operands stay in between operators (a CPU's last level, a GPU's L2; 0: unknown), and whether
    # every rank on the machine writes into it (a CPU's last level; a GPU's L2 is its own)
    cache_bytes: float = 0.0
    cache_shared: bool = False
    # {family: [[bytes per call, bytes written since its operands were touched, bytes/s], ...]}: the
    # families timed after W bytes of other writes, W from a sixteenth of the cache to past it
    # (the top row: elementwise_ops). A step is priced at its own writes (rates_after)
    elementwise_ops_after: dict = field(default_factory=dict)
    # {dtype: {shape_key: FLOP/s}}: a model's own matmul shapes timed alone (roofline/shapes.py),
    # read before the grid: a CPU's kernel library picks its kernel by shape, so the rate is not
    # smooth between grid points (bf16 at (1024, 768, 768) 1.6 TFLOP/s, at (1024, 2304, 768) 3.3)
    matmul_shapes: dict = field(default_factory=dict)
    source: str = "measured"


def datasheet_roof(name: str, peak: float, bandwidth: float) -> Roof:
    """A named accelerator's roof: the datasheet peak at every shape, its memory bandwidth, no
    launch cost (unknown from a datasheet; on a GPU a launch is a few microseconds)."""
    flat = {dtype: [[1, 1, 1, peak]] for dtype in ("float32", "bfloat16")}
    flat2 = {dtype: [[1, 1, peak]] for dtype in ("float32", "bfloat16")}
    return Roof(name, bandwidth, flat, flat2, flat2, [[1, bandwidth]], source="datasheet")


def interpolate(points: list, at: tuple) -> float:
    """The value at `at` on a regular grid of points [dims..., value]: multilinear in log2 of the
    dimensions and in log of the value, each dimension clamped to the grid's range."""
    dims = len(at)
    axes = [sorted({p[i] for p in points}) for i in range(dims)]
    table = {tuple(p[:dims]): p[dims] for p in points}
    corners = [[]]  # (grid coordinates, weight) of the 2^dims corners around `at`
    weights = [1.0]
    for axis, x in zip(axes, at):
        x = min(max(x, axis[0]), axis[-1])
        upper = next(i for i, v in enumerate(axis) if v >= x)
        lower = max(upper - 1, 0)
        lo, hi = axis[lower], axis[upper]
        t = 0.0 if hi == lo else (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        corners = [c + [v] for c in corners for v in (lo, hi)]
        weights = [w * s for w in weights for s in (1 - t, t)]
    return math.exp(sum(w * math.log(table[tuple(c)]) for c, w in zip(corners, weights) if w))


def rate_dtype(dtype: str) -> str:
    """The measured dtype standing in for `dtype`: 16-bit and fp8 matmuls at bf16's rates."""
    return "float32" if dtype in ("float32", "tf32") else "bfloat16"


def shape_key(operator: str, m: int, n: int, k: int, layout: str) -> str:
    """A matmul call's key in Roof.matmul_shapes: the operator (mm; addmm, which adds a bias),
    "MxNxK" and its operands' layout ("nt": A as stored, B transposed, as F.linear calls it)."""
    return f"{operator} {m}x{n}x{k} {layout}"


def compute_rate(roof: Roof, op) -> float:
    """Achieved FLOP/s of `op` (ops.Op) at its shape, or 0 for an op with no FLOPs: a
    matmul's own shape and layout if timed (Roof.matmul_shapes), else read off the grid."""
    if not op.flops:
        return 0.0
    if op.kind == "matmul" and getattr(op, "layout", ""):
        timed = roof.matmul_shapes.get(rate_dtype(op.dtype), {}).get(shape_key(op.op, *op.shape, op.layout))
        if timed:
            return timed
    grid = {"matmul": roof.matmul, "sdpa_forward": roof.sdpa_forward, "sdpa_backward": roof.sdpa_backward}[op.kind]
    return interpolate(grid[rate_dtype(op.dtype)], op.shape)


# The measured families of elementwise operators (elementwise.measure_elementwise_ops), by
# the aten name's stem: each family's rate at a call's size stands for its members'.
FAMILIES = {
    "binary": ("add", "sub", "mul", "div", "where", "lerp", "addcmul", "addcdiv", "maximum", "clamp",
               "threshold_backward", "silu_backward", "embedding_dense_backward", "gelu", "gelu_backward"),
    # NLL's backward is a zero-fill of its gradient, its forward a gather
    "unary": ("neg", "rsqrt", "sqrt", "pow", "exp", "reciprocal", "silu", "tanh", "sigmoid", "fill",
              "zero", "ones_like", "zeros_like", "nll_loss_backward"),
    "copy": ("_to_copy", "copy", "clone", "cat", "stack", "embedding", "index_select", "_unsafe_view",
             "nll_loss_forward"),
    "reduce": ("mean", "sum", "amax"),  # along rows: RMSNorm's mean, a broadcast gradient's sum
    "vector_norm": ("linalg_vector_norm", "norm"),  # a whole tensor to one number: clipping's norms
    "softmax": ("_log_softmax", "_softmax", "_log_softmax_backward_data", "_softmax_backward_data"),
}
_FAMILY_OF = {stem: family for family, stems in FAMILIES.items() for stem in stems}


def family_of(aten: str) -> str:
    """The measured family of an aten operator ("_foreach_mul" and "mul" are "mul"'s), or "". An
    in-place binary op ("mul_", "_foreach_addcdiv_") is "binary_inplace": it writes back over an
    operand it has just read, where an out-of-place op's fresh output is read into cache before it
    is written (write-allocate), so it moves fewer bytes than it counts (AdamW's in-place steps on
    small ran 1.3-2.2x faster than the out-of-place rate said, its out-of-place sqrt 0.64x)."""
    stem = aten.removeprefix("_foreach_").rstrip("_") if aten.startswith("_foreach") else aten.rstrip("_")
    family = _FAMILY_OF.get(stem, _FAMILY_OF.get(aten, ""))
    return "binary_inplace" if family == "binary" and aten.endswith("_") else family


def memory_rate(roof: Roof, op) -> float:
    """Bytes/s `op` moves at: elementwise ops at the rate measured for calls of their size and
    family (operands out of cache; a reduction or a cast runs at its own rate), everything else
    at the large-copy bandwidth. A foreach op's size is its whole list's bytes: the CPU runs its
    tensors back to back, one stream that the prefetcher follows from tensor to tensor, not as
    many cold starts (AdamW's steps on small, priced per tensor, came out 2.4x the measured)."""
    if op.kind in ("elementwise", "foreach") and op.calls:
        family = family_of(getattr(op, "op", ""))
        grids = roof.elementwise_ops
        grid = grids.get(family) or grids.get(family.removesuffix("_inplace")) or roof.elementwise
        size = op.bytes if op.kind == "foreach" else op.bytes / op.calls
        return interpolate(grid, (max(size, 1.0),))
    return roof.bandwidth


def rates_after(roof: Roof, written: float) -> dict:
    """{family: [[bytes per call, bytes/s]]}: the elementwise_ops_after grid read at `written`
    bytes of other writes since the operands were last touched (interpolated in log W, clamped to
    the grid's W: a step writing less than its smallest W reads at that W's rate, near the warm
    one; one writing more than its largest at the cold rates)."""
    rates = {}
    for family, points in roof.elementwise_ops_after.items():
        sizes = sorted({p[0] for p in points})
        rates[family] = [[size, interpolate(points, (size, max(written, 1.0)))] for size in sizes]
    return rates


def op_time(roof: Roof, op) -> dict:
    """One operation's predicted seconds and the bound it hits: max(FLOPs / rate, bytes / bandwidth)
    (whichever is larger is the bound), plus its kernel launches."""
    if op.kind == "collective":  # at its operator's measured latency and bandwidth, else all-reduce's
        c = roof.collective.get("operators", {}).get(op.op, roof.collective)
        seconds = op.calls * c["latency_s"] + op.bytes / c["bytes_per_second"] if c else 0.0
        return {"seconds": seconds, "compute_s": 0.0, "memory_s": seconds, "bound": "network" if c else "not measured"}
    rate = compute_rate(roof, op)
    compute_s = op.flops / rate if rate else 0.0
    memory_s = op.bytes / memory_rate(roof, op) if op.bytes else 0.0
    per_call = {"foreach": roof.foreach_call_seconds,
                "view": roof.call_seconds if roof.view_call_seconds is None else roof.view_call_seconds
                }.get(op.kind, roof.call_seconds)
    launch_s = op.calls * per_call
    return {"seconds": max(compute_s, memory_s) + launch_s, "compute_s": compute_s, "memory_s": memory_s,
            "launch_s": launch_s, "bound": "compute" if compute_s >= memory_s else "memory"}


def predict(roof: Roof, ops: list, tokens_per_step: int) -> dict:
    """The step's predicted time, summed by operation class, JSON-ready. No overlap is assumed:
    eager execution on one device runs one kernel at a time, so every term adds. The collectives
    of DDP and ZeRO start during backward (async, bucket by bucket) and ZeRO's parameter gather
    after the update; on CPU gloo runs them on threads of the cores the ranks compute on, so their
    time is taken from compute rather than hidden behind it (bench/step_time_dist.py measures the
    part left exposed)."""
    classes = {name: {"seconds": 0.0, "flops": 0.0, "bytes": 0.0, "compute_s": 0.0, "memory_s": 0.0,
                      "launch_s": 0.0, "ops": 0} for name in CLASSES}
    for op in ops:
        t = op_time(roof, op)
        row = classes[op.cls]
        row["seconds"] += t["seconds"]
        row["flops"] += op.flops
        row["bytes"] += op.bytes
        row["ops"] += 1
        for key in ("compute_s", "memory_s", "launch_s"):
            row[key] += t.get(key, 0.0)
    for row in classes.values():
        row["bound"] = ("-" if not row["ops"] else "compute" if row["compute_s"] >= row["memory_s"] else "memory")
        busy = row["seconds"] - row["launch_s"]
        row["achieved_flops_per_second"] = row["flops"] / busy if busy > 0 else 0.0
        row["intensity_flops_per_byte"] = row["flops"] / row["bytes"] if row["bytes"] else 0.0
    step = sum(row["seconds"] for row in classes.values())
    peaks = {dtype: max(row[-1] for row in rows) for dtype, rows in roof.matmul.items()}
    return {"roof": roof.name, "roof_source": roof.source, "seconds_per_step": step,
            "bandwidth_bytes_per_second": roof.bandwidth, "best_matmul_flops_per_second": peaks,
            "tokens_per_second": tokens_per_step / step if step else 0.0,
            "classes": {name: row for name, row in classes.items() if row["ops"]},
            "overlap": "none assumed (eager: one kernel at a time; collectives added in full)"}
