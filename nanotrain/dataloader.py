"""
The pretraining token loader: streams documents, prepends BOS, tokenizes them in batches (tiktoken, threaded),
packs the tokens into rows of max_seq_len + 1 and yields (inputs, targets) of shape (batch_size, max_seq_len).

Documents are cut at row boundaries (the nanoGPT / nanochat v0 packing): every token is trained exactly once per
epoch. Under DDP, rank r reads the documents whose global index i has i % world_size == r, so ranks see disjoint data.
The state is the position of the next unseen token: (epoch, index of the document it belongs to, offset of the token
inside that document's tokens), so resume continues exactly at the next unseen tokens, whatever the batch size.
"""

import numpy as np
import torch

from nanotrain.common import UserError
from nanotrain.dataset import iter_documents


class TokenLoader:
    """
    Iterator over (inputs, targets) int64 tensors of shape (batch_size, max_seq_len) on `device`,
    targets[i, t] = inputs[i, t + 1] (the rows are windows of max_seq_len + 1 consecutive tokens).

    tokenizer: a nanotrain.tokenizer.Tokenizer; files: the data files of one split (nanotrain.dataset).
    loop: start a new epoch when the data is exhausted (else StopIteration).
    Raises UserError if this rank gets no document at all.
    """

    def __init__(self, tokenizer, files, batch_size, max_seq_len, device, rank=0, world_size=1,
                 loop=True, tokenizer_batch_docs=128, num_threads=4):
        self.tokenizer, self.files = tokenizer, list(files)
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.device = torch.device(device)
        self.rank, self.world_size, self.loop = rank, world_size, loop
        self.tokenizer_batch_docs, self.num_threads = tokenizer_batch_docs, num_threads
        self.bos = tokenizer.get_bos_token_id()
        self.epoch = 0
        self._buffer = []  # list of [doc_index, np.int32 array of tokens (BOS first)]
        self._offset = 0   # tokens of _buffer[0] already consumed
        self._next_doc = 0  # global index of the next document to read from the files
        self._docs = None  # document iterator of the current epoch
        self._epoch_docs = 0  # documents this rank read in the current epoch (0 at the end: no data for this rank)

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """The position of the next unseen token: {"epoch", "doc_index", "offset"} (JSON-serialisable ints)."""
        if self._buffer:
            return {"epoch": self.epoch, "doc_index": int(self._buffer[0][0]), "offset": int(self._offset)}
        return {"epoch": self.epoch, "doc_index": int(self._next_doc), "offset": 0}

    def load_state_dict(self, state):
        """Continues from a position given by state_dict() (of a loader over the same files, rank and world size)."""
        self.epoch = int(state["epoch"])
        self._buffer, self._offset, self._docs = [], 0, None
        self._next_doc = int(state["doc_index"])
        self._epoch_docs = 1 if self._next_doc > 0 else 0
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
        """Tokenizes documents into the buffer until it holds at least `need` unconsumed tokens."""
        have = sum(len(t) for _, t in self._buffer) - self._offset
        while have < need:
            docs = self._read_docs(self.tokenizer_batch_docs)
            if not docs:
                if not self.loop:
                    return
                if self._epoch_docs == 0:
                    more = " ..." if len(self.files) > 3 else ""
                    raise UserError(f"rank {self.rank} of {self.world_size} got no document from "
                                    f"{self.files[:3]}{more}: the data split is too small for this many ranks")
                self.epoch += 1
                self._next_doc, self._docs, self._epoch_docs = 0, None, 0
                continue
            self._epoch_docs += len(docs)
            ids = self.tokenizer.encode([t for _, t in docs], prepend=self.bos, num_threads=self.num_threads)
            for (idx, _), toks in zip(docs, ids):
                self._buffer.append([idx, np.asarray(toks, dtype=np.int32)])
                have += len(toks)

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

    # ------------------------------------------------------------------ batches
    def next_batch(self, batch_size=None):
        """
        The next (inputs, targets), each int64 (batch_size, max_seq_len) on the device. batch_size defaults to the
        loader's. Raises StopIteration at the end of a non-looping loader.
        """
        B, T = batch_size or self.batch_size, self.max_seq_len
        tokens = self._take(B * (T + 1))
        if len(tokens) < B * (T + 1):
            raise StopIteration
        rows = torch.from_numpy(tokens).view(B, T + 1)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()
