"""
The pretraining-style token loaders: rows of max_seq_len + 1 consecutive tokens, yielded as (inputs, targets) of shape
(batch_size, max_seq_len), with an exactly resumable state.

TokenLoader (base_train): streams documents, prepends BOS, tokenizes them in batches (tiktoken, threaded) and packs
the tokens into rows. Under DDP, rank r reads the documents whose global index i has i % world_size == r, so ranks
see disjoint data. With row_packing="contiguous" (the default) documents are cut at row boundaries (the nanoGPT /
nanochat v1 packing): every token is trained exactly once per epoch, and the state is the position of the next unseen
token: (epoch, index of the document it belongs to, offset of the token inside that document's tokens), so resume
continues exactly at the next unseen tokens, whatever the batch size.

Best-fit rows (TokenLoader(row_packing="best_fit" or "bos_aligned")): rows are filled from a buffer of
`buffer_docs` pieces (documents, BOS first, in reading order): a piece at least a row long heads the next row (it is
cut there, which it would be anywhere); otherwise the largest piece that still fits goes in (the oldest of equal
length), and when none fits the shortest one is cut to fill the row exactly. No padding either way. They differ in
what becomes of the part of a piece that was cut off:
- "best_fit" puts it back into the buffer as a piece of its own, so no token is lost and a document is cut only where
  it must be (the idea of Ding et al. 2024, "Fewer Truncations Improve Language Modeling"); such a piece can head a
  row, so not every row starts at a BOS;
- "bos_aligned" drops it (nanochat 2026's loader): every row starts at a document's BOS, at the price of the dropped
  tokens (the cut-off parts of documents longer than the room left in a row).
How many rows start at a BOS and how many tokens are dropped on the builtin corpus: dev/LOG.md, "Row packings on the
builtin corpus".
The state is the reading position plus the buffered pieces' tokens, so resume is exact here too, and n rows at once
are the same rows as n calls of one.

Prefetch (on by default on CUDA, off elsewhere): after the first batch, a background thread reads, tokenizes and packs
the next batch while the trainer computes (a queue of `prefetch` batches; the main thread only moves a batch to the
device). Every queued batch carries the loader state after it, so state_dict() describes what the caller has
received, never what the thread read ahead; asking for another batch size drops the queued batches and rewinds to
that state (exact). Off on CPU: there the loader's work is small next to a training step, and the thread competes
with torch's threads for the cores. On CUDA the main thread waits for the GPU at every step's loss sync, which the
thread can use.

Mid-training's rows, cut from tokenized conversations the same way, are nanotrain.sft_data.ConversationTokenStream.
"""

import atexit
import queue
import threading
import weakref

import numpy as np
import torch

from nanotrain.dataset import iter_documents
from nanotrain.errors import UserError

_THREADS = weakref.WeakSet()  # live prefetch threads, each with its stop event as .stop
ROW_PACKINGS = ("contiguous", "best_fit", "bos_aligned")  # TokenLoader's row_packing (module docstring)


@atexit.register
def _stop_prefetch_threads():
    """
    Stops every prefetch thread before the interpreter shuts down: a daemon thread caught inside tokenizer or torch
    code during finalisation aborts the process ("terminate called without an active exception").
    """
    threads = list(_THREADS)
    for t in threads:
        t.stop.set()
    for t in threads:
        t.join(timeout=10)


def _prefetch_worker(ref, batch_size, out, stop):
    """
    The background thread: produces batches of `batch_size` rows from the loader behind the weak reference `ref`
    into the queue `out` as (rows, state after them, exception or None) until `stop` is set, the loader is garbage
    collected, or producing raises (the exception, StopIteration included, is queued and the thread ends).
    """
    while not stop.is_set():
        loader = ref()
        if loader is None:
            return
        try:
            item = (loader._make_rows(batch_size), loader._producer_state(), None)
        except BaseException as e:  # handed to the caller's thread, which raises it
            item = (None, None, e)
        del loader  # no strong reference while waiting: an abandoned loader can be collected and the thread ends
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                if ref() is None:
                    return
        if item[2] is not None:
            return


class TokenLoader:
    """
    Iterator over (inputs, targets) int64 tensors of shape (batch_size, max_seq_len) on `device`,
    targets[i, t] = inputs[i, t + 1] (the rows are windows of max_seq_len + 1 consecutive tokens).

    tokenizer: a nanotrain.tokenizer.Tokenizer; files: the data files of one split (nanotrain.dataset).
    loop: start a new epoch when the data is exhausted (else StopIteration).
    row_packing: "contiguous" (the documents' tokens in order, cut at row boundaries), "best_fit" or "bos_aligned"
    (rows filled from a buffer of `buffer_docs` pieces: module docstring). Raises ValueError for another value.
    prefetch: batches produced ahead by a background thread (0: no thread; the batches and states are identical);
    None: 1 on CUDA, 0 elsewhere (see the module docstring).
    Raises UserError if this rank gets no document at all.
    """

    def __init__(self, tokenizer, files, batch_size, max_seq_len, device, rank=0, world_size=1,
                 loop=True, tokenizer_batch_docs=128, num_threads=4, prefetch=None, row_packing="contiguous",
                 buffer_docs=1000):
        self.tokenizer, self.files = tokenizer, list(files)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.device = torch.device(device)
        self.rank, self.world_size, self.loop = rank, world_size, loop
        self.tokenizer_batch_docs, self.num_threads = tokenizer_batch_docs, num_threads
        self.prefetch = (1 if self.device.type == "cuda" else 0) if prefetch is None else prefetch
        if row_packing not in ROW_PACKINGS:
            raise ValueError(f"row_packing={row_packing!r}: expected one of {', '.join(ROW_PACKINGS)}")
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs={buffer_docs}: expected >= 1")
        self.row_packing, self.buffer_docs = row_packing, buffer_docs
        self.buffered = row_packing != "contiguous"  # rows from the buffer of pieces (best fit)
        self.bos = tokenizer.get_bos_token_id()
        self._epoch = 0
        self._buffer = []  # list of [doc_index, np.int32 array of its tokens (BOS first, or a cut-off part)]
        self._lengths = []  # buffered: the lengths of _buffer's pieces
        self._offset = 0   # tokens of _buffer[0] already consumed (always 0 when buffered)
        self._next_doc = 0  # global index of the next document to read from the files
        self._docs = None  # document iterator of the current epoch
        self._epoch_docs = 0  # documents this rank read in the current epoch (0 at the end: no data for this rank)
        self._thread = None  # the prefetch thread, its queue, stop event and batch size
        self._queue = self._stop = self._thread_rows = None
        self._state = None  # while the thread runs: the state after the last batch handed to the caller

    # ------------------------------------------------------------------ state
    @property
    def epoch(self):
        """The epoch of the next unseen token (0-based)."""
        return self.state_dict()["epoch"]

    def _producer_state(self):
        """The position of the next token the producer has not packed yet (ahead of the caller while prefetching);
        buffered: the reading position and the buffered pieces (their arrays are never modified)."""
        if self.buffered:
            return {"epoch": self._epoch, "doc_index": int(self._next_doc), "buffer": list(self._buffer)}
        if self._buffer:
            return {"epoch": self._epoch, "doc_index": int(self._buffer[0][0]), "offset": int(self._offset)}
        return {"epoch": self._epoch, "doc_index": int(self._next_doc), "offset": 0}

    def state_dict(self):
        """
        The position of the next token the caller has not received: {"epoch", "doc_index", "offset"} (ints). With
        best-fit rows: {"epoch", "doc_index" (the next document to read, ints), "buffer_docs" (int64 (n, 2): document
        index and length of each buffered piece, in buffer order), "buffer_tokens" (int32: their tokens,
        concatenated)}. Batches the prefetch thread has produced but not handed out are not counted.
        """
        state = dict(self._state) if self._thread is not None else self._producer_state()
        if self.buffered:
            docs = state.pop("buffer")
            state["buffer_docs"] = torch.tensor([[i, len(t)] for i, t in docs], dtype=torch.int64).view(-1, 2)
            state["buffer_tokens"] = torch.from_numpy(np.concatenate([t for _, t in docs] or
                                                                     [np.zeros(0, dtype=np.int32)]))
        return state

    def load_state_dict(self, state):
        """
        Continues from a position given by state_dict() (of a loader over the same files, rank, world size and
        row_packing). Raises UserError when the state is of contiguous rows and this loader's are best-fit, or the
        reverse, or when it does not match the files.
        """
        self._stop_prefetch(rewind=False)
        if self.buffered != ("buffer_docs" in state):
            raise UserError(f"loader state of {'best-fit' if 'buffer_docs' in state else 'contiguous'} rows, but this "
                            f"run packs --row_packing={self.row_packing}; resume with the --row_packing of the "
                            f"checkpoint")
        self._epoch = int(state["epoch"])
        self._buffer, self._lengths, self._offset, self._docs = [], [], 0, None
        self._next_doc = int(state["doc_index"])
        self._epoch_docs = 1 if self._next_doc > 0 else 0
        if self.buffered:
            tokens = np.asarray(state["buffer_tokens"], dtype=np.int32)
            start = 0
            for idx, length in np.asarray(state["buffer_docs"]).tolist():
                self._buffer.append([idx, tokens[start:start + length]])
                self._lengths.append(length)
                start += length
            return
        skip = int(state["offset"])
        if skip:
            self._fill(1)
            if not self._buffer or self._buffer[0][0] != state["doc_index"]:
                raise UserError(f"loader state {state} does not match the data files (document not found); "
                                f"resume with the same --data and world size")
            self._offset = skip

    # ------------------------------------------------------------------ reading
    def _read_docs(self, n):
        """Reads up to n of this rank's documents; returns [(doc_index, text)] (empty at the end of an epoch)."""
        if self._docs is None:
            self._docs = iter_documents(self.files, start=self._next_doc)
        out = []
        for idx, text in self._docs:
            self._next_doc = idx + 1
            if idx % self.world_size == self.rank:
                out.append((idx, text))
                if len(out) == n:
                    break
        return out

    def _fill(self, need):
        """Tokenizes documents into the buffer until it holds at least `need` unconsumed tokens (buffered: at least
        `need` pieces). Fewer only at the end of a non-looping loader."""
        have = len(self._buffer) if self.buffered else sum(len(t) for _, t in self._buffer) - self._offset
        while have < need:
            docs = self._read_docs(self.tokenizer_batch_docs)
            if not docs:
                if not self.loop:
                    return
                if self._epoch_docs == 0:
                    more = " ..." if len(self.files) > 3 else ""
                    raise UserError(f"rank {self.rank} of {self.world_size} got no document from "
                                    f"{self.files[:3]}{more}: the data split is too small for this many ranks")
                self._epoch += 1
                self._next_doc, self._docs, self._epoch_docs = 0, None, 0
                continue
            self._epoch_docs += len(docs)
            ids = self.tokenizer.encode([t for _, t in docs], prepend=self.bos, num_threads=self.num_threads)
            for (idx, _), toks in zip(docs, ids):
                self._buffer.append([idx, np.asarray(toks, dtype=np.int32)])
                if self.buffered:
                    self._lengths.append(len(toks))
                have += 1 if self.buffered else len(toks)

    def _take(self, n):
        """Removes and returns the next n tokens as an np.int64 array (fewer only at the end of a non-looping run)."""
        self._fill(n)
        parts, got = [], 0
        while got < n and self._buffer:
            idx, toks = self._buffer[0]
            piece = toks[self._offset:self._offset + (n - got)]
            parts.append(piece)
            got += len(piece)
            self._offset += len(piece)
            if self._offset == len(toks):
                self._buffer.pop(0)
                self._offset = 0
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def _best_fit_row(self):
        """
        The next best-fit row of max_seq_len + 1 tokens as an np.int64 array (module docstring: a piece at least a row
        long heads it; then the largest piece that fits, oldest first; when none fits, the shortest one is cut, and
        with "best_fit" its rest goes back into the buffer). Raises StopIteration when a non-looping loader's pieces
        cannot fill it.
        """
        row_len = self.max_seq_len + 1
        parts, space = [], row_len
        while space > 0:
            self._fill(self.buffer_docs)
            if not self._buffer:
                raise StopIteration
            lengths = np.asarray(self._lengths)
            longer = np.flatnonzero(lengths >= row_len) if space == row_len else ()
            fits = np.flatnonzero(lengths <= space)
            if len(longer):
                i = longer[0]
            elif len(fits):
                i = fits[np.argmax(lengths[fits])]  # argmax/argmin: the first, i.e. the oldest, of equal length
            else:
                i = np.argmin(lengths)
            idx, toks = self._buffer.pop(i)
            self._lengths.pop(i)
            parts.append(toks[:space])
            if len(toks) > space and self.row_packing == "best_fit":  # the rest is a piece of its own
                self._buffer.append([idx, toks[space:]])
                self._lengths.append(len(toks) - space)
            space -= len(parts[-1])
        return np.concatenate(parts).astype(np.int64)

    def _make_rows(self, batch_size):
        """
        The next batch_size rows of max_seq_len + 1 tokens as a CPU int64 tensor (pinned when the device is CUDA).
        Raises StopIteration at the end of a non-looping loader.
        """
        T = self.max_seq_len
        tokens = (np.concatenate([self._best_fit_row() for _ in range(batch_size)]) if self.buffered
                  else self._take(batch_size * (T + 1)))
        if len(tokens) < batch_size * (T + 1):
            raise StopIteration
        rows = torch.from_numpy(tokens).view(batch_size, T + 1)
        return rows.pin_memory() if self.device.type == "cuda" else rows

    # ------------------------------------------------------------------ prefetch thread
    def _start_prefetch(self, batch_size):
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._state, self._thread_rows = self._producer_state(), batch_size
        self._thread = threading.Thread(target=_prefetch_worker, args=(weakref.ref(self), batch_size, self._queue,
                                                                      self._stop), daemon=True,
                                        name="TokenLoader-prefetch")
        self._thread.stop = self._stop
        _THREADS.add(self._thread)
        self._thread.start()

    def _stop_prefetch(self, rewind=True):
        """Stops the thread, drops the batches it produced ahead and (rewind) moves the producer back to the caller's
        position: the state recorded with the last batch handed out, reloaded exactly as a resume would."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        state = self.state_dict()  # the caller's position, in the form load_state_dict takes
        self._thread = self._queue = None
        if rewind:
            self.load_state_dict(state)

    def close(self):
        """Stops the prefetch thread (if any); the loader stays usable (the thread restarts on demand)."""
        self._stop_prefetch()

    def __del__(self):
        if getattr(self, "_stop", None) is not None:
            self._stop.set()

    def _next_rows(self, batch_size):
        """The next rows for the caller: from the prefetch queue when the thread runs with this batch size."""
        if self._thread is not None and self._thread_rows != batch_size:
            self._stop_prefetch()  # another batch size: rewind to the caller's position, then produce this size
        if self._thread is None:
            rows = self._make_rows(batch_size)  # the first batch (or prefetch off) is made here
            if self.prefetch > 0:
                self._start_prefetch(batch_size)
            return rows
        rows, state, err = self._queue.get()
        if err is not None:  # the thread ended: the producer is where the synchronous path would be
            self._thread.join()
            self._thread = self._queue = None
            raise err
        self._state = state
        return rows

    # ------------------------------------------------------------------ batches
    def next_batch(self, batch_size=None):
        """
        The next (inputs, targets), each int64 (batch_size, max_seq_len) on the device. batch_size defaults to the
        loader's. Raises StopIteration at the end of a non-looping loader.
        """
        rows = self._next_rows(batch_size or self.batch_size)
        if self.device.type == "cuda":  # one copy from pinned memory, overlapping whatever the GPU is doing
            rows = rows.to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            rows = rows.to(self.device)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()
