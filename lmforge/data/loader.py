"""Batches of random windows from a token file, prepared ahead by a background thread.

Batch number i holds `batch_size` windows whose start offsets are drawn from a generator seeded
with (seed, i): any batch can be rebuilt from its number alone. The loader's whole state is
therefore the number of batches handed out, which the checkpoint stores, and a resumed run sees
exactly the batches an uninterrupted run would have seen.

Under data parallelism batch i is the global batch: `batch_size * world_size` windows drawn the
same way, of which rank r takes rows r*batch_size .. (r+1)*batch_size. So N ranks of batch_size B
see together exactly what one process of batch_size N*B sees, a batch is still a pure function of
(seed, i, rank), and a run resumes on another number of ranks with the same global batch.

    x = tokens[s : s + seq_len],   y = tokens[s + 1 : s + seq_len + 1]   (next-token targets)
"""

import queue
import threading
import time

import numpy as np
import torch

from lmforge.common.errors import LmforgeError


def check_windows(train_tokens: int, val_tokens: int, seq_len: int) -> None:
    """LmforgeError unless both splits hold one window of seq_len + 1 tokens (inputs and targets)."""
    if min(train_tokens, val_tokens) < seq_len + 1:
        raise LmforgeError(f"the corpus is too small for windows of {seq_len} tokens ({train_tokens} train, "
                           f"{val_tokens} val tokens): add text or lower train.seq_len")


def window_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, index: int,
                 pin_memory: bool = False, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of batch number `index` of the stream seeded with `seed`: the same on
    every call and machine."""
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size * world_size)[rank * batch_size:
                                                                                   (rank + 1) * batch_size]
    windows = torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64))
    if pin_memory:
        windows = windows.pin_memory()
    return windows[:, :-1], windows[:, 1:]


class BatchLoader:
    """This rank's part of batch `start`, `start` + 1, ... (batch_size windows each)."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 start: int = 0, prefetch: int = 4, device: str | torch.device = "cpu",
                 rank: int = 0, world_size: int = 1, make_batch=window_batch):
        """`make_batch` draws batch number i (window_batch, or data/sft.py's example_batch for
        fine-tuning examples; the same signature)."""
        if make_batch is window_batch and len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {seq_len} + 1")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.rank, self.world_size, self.make_batch = rank, world_size, make_batch
        self.device = torch.device(device)
        self.position = start  # number of batches handed out so far
        self.wait_seconds = 0.0  # time the consumer spent blocked on an empty queue
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._error: BaseException | None = None  # what stopped the producer, raised by every later __next__
        self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True)
        self._thread.start()

    def _produce(self, index: int) -> None:
        try:
            while not self._stop.is_set():
                batch = self.make_batch(self.tokens, self.batch_size, self.seq_len, self.seed, index,
                                        pin_memory=self.device.type == "cuda", rank=self.rank,
                                        world_size=self.world_size)
                self._queue.put(batch)  # sleeps until the consumer takes one: no polling
                index += 1
        except BaseException as err:  # hand it to the consumer, which would otherwise wait forever
            self._queue.put(err)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._error is not None:
            raise self._error
        started = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - started
        if isinstance(item, BaseException):  # the producer failed making this batch and has stopped
            self._error = item
            raise item
        x, y = item
        self.position += 1
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # free a slot so that a producer blocked in put() sees the flag
            try:
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
