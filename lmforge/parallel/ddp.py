"""Data parallelism written out (what torch.nn.parallel.DistributedDataParallel does, readable).

Every rank holds the whole model and optimizer and runs its own rows of the global batch; the
gradients are averaged over the ranks before the step, so every rank takes the same step.

The averaging overlaps backward. Parameters are packed, in reverse registration order (roughly
the order backward produces their gradients: the head first, the embedding last), into buckets
of about `bucket_mb` MiB. A hook that autograd calls once a parameter's gradient is complete
(`register_post_accumulate_grad_hook`) copies it into its bucket and makes `param.grad` a view
of that slice (one copy of the gradients, not two); when a bucket's last gradient arrives, its
all-reduce starts asynchronously while backward goes on with earlier layers. `finish_gradients`
waits for them all and divides by N: sum / N is the gradient of the mean loss over the global
batch. Inside `no_sync()` (accumulation micro-steps) the hooks do nothing: gradients accumulate
locally and only the last micro-batch's backward communicates.

Per step each rank sends 2 (N-1)/N Psi gradient elements (ring all-reduce; parallel/comm.py).

A pipeline stage's replicas (parallel/pipeline/engine.py) take this engine without buckets
(`bucket_mb` None): a pipeline step runs a backward per micro-batch, so the hooks would fire m
times; instead each gradient is all-reduced once after the schedule and divided by N (strategy
none on a pipeline: one replica, nothing to reduce). Frozen parameters (a LoRA base) take no part.
"""


import itertools

import torch

from lmforge.parallel.engine import Engine


class Bucket:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.offsets = [0, *itertools.accumulate(p.numel() for p in params)]  # where each parameter starts
        self.flat = torch.zeros(self.offsets[-1], dtype=params[0].dtype, device=params[0].device)
        self.ready = 0  # gradients copied in during this backward
        self.work = None  # the all-reduce in flight

    def view(self, index: int) -> torch.Tensor:
        p = self.params[index]
        return self.flat[self.offsets[index]:self.offsets[index + 1]].view_as(p)


class DDPEngine(Engine):
    data_parallel = True

    def __init__(self, model, optimizer, groups, bucket_mb: float | None):
        super().__init__(model, optimizer, groups)
        self.broadcast_from_rank0()
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.buckets: list[Bucket] = []
        current, size = [], 0
        for p in reversed(self.params if bucket_mb is not None else []):
            if current and (size + p.nbytes > bucket_mb * 2**20 or p.dtype != current[0].dtype):
                self.buckets.append(Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.nbytes
        if current:
            self.buckets.append(Bucket(current))
        self.place = {p: (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for p in self.place]

    def _gradient_ready(self, param: torch.nn.Parameter) -> None:
        if not self.syncing:
            return
        bucket, index = self.place[param]
        view = bucket.view(index)
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view  # the gradient lives in its bucket from now on
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.work = self.comm.all_reduce(bucket.flat, async_op=True)

    def finish_gradients(self) -> None:
        if not self.buckets and self.world_size > 1:  # a pipeline stage's: the mean over its replicas
            for grad, _ in self.local_pieces():
                self.comm.all_reduce(grad)
                grad.div_(self.world_size)
        for bucket in self.buckets:
            if bucket.work is None:
                missing = [p.shape for p in bucket.params if p.grad is None]
                raise RuntimeError(f"DDP: a bucket was never reduced: parameters of shapes {missing} got no "
                                   f"gradient in this backward (every parameter must take part in the loss)")
            bucket.work.wait()
            bucket.flat.div_(self.world_size)
            bucket.ready, bucket.work = 0, None
