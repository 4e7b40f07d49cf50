"""
A reply's text as its tokens come, for the server (scripts/chat_serve.py): readable pieces that never hold half a
character, cut before the first stop string, and never showing a character that a stop string may yet claim.
"""

from nanotrain.engine import TextStream, readable


class Reply:
    """
    One request's reply as it comes. add(tokens, final) returns (the new text to send, stopped): the tokens decoded
    through nanotrain.engine.TextStream (never half a character; the calculator's tokens shown as chat_cli shows them,
    nanotrain.engine.readable), with `stop` (a list of strings) applied: stopped is True once a stop string appeared,
    and the text sent, all pieces joined, is then the reply up to the first stop string (not included). Until a
    piece is final, its end is held back as long as it could begin a stop string (e.g. with stop "-e-" a text
    ending in "-e" waits for the next token), so no piece shows what a later one would have to take back.
    count: the tokens added (int).
    """

    def __init__(self, tokenizer, stop=()):
        self.stop, self.stream, self.text, self.sent, self.count = list(stop), TextStream(tokenizer, readable), "", 0, 0

    def held(self):
        """How many characters at the end of the unsent text could begin a stop string (int)."""
        tail = self.text[self.sent:]
        for k in range(min(len(tail), max(map(len, self.stop)) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0

    def add(self, tokens, final=False):
        self.count += len(tokens)
        self.text += self.stream.add(tokens, final)
        if self.stop:  # nothing sent can begin a stop string (held back), so one starts at `sent` or later
            cut = min((i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                out, self.sent = self.text[self.sent:cut], cut
                return out, True
        end = len(self.text) - (0 if final or not self.stop else self.held())
        out, self.sent = self.text[self.sent:end], end
        return out, False
