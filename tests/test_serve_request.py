"""
The server's request record and reply text (nanotrain.serve.request, nanotrain.serve.reply) without a server: a
chat request's max_tokens against the context, and stop strings that never leak into a streamed reply.
"""

import pytest

from nanotrain.serve.reply import Reply
from nanotrain.serve.request import APIError, GenerationRequest, chat_request, new_tokens

pytestmark = pytest.mark.unit


class CharTok:
    """One token per character (its code point): decode joins them."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def stream(text, stop, piece):
    """The pieces Reply sends for `text` fed `piece` characters at a time, then final: (pieces, stopped)."""
    reply, pieces = Reply(CharTok(), stop), []
    ids = [ord(c) for c in text]
    for i in range(0, len(ids), piece):
        out, stopped = reply.add(ids[i:i + piece], final=i + piece >= len(ids))
        pieces.append(out)
        if stopped:
            return pieces, True
    return pieces, False


@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_a_stop_string_never_leaks(piece):
    """
    stop ["-e-"] on the reply "Spell-e-e-e-e-e", fed 1, 2, 3 or 7 characters at a time: the pieces sent join to
    "Spell" (the reply before the first stop string) and stopped is set; a stop string that never comes holds
    nothing back at the end ("a-" with stop "-e-" sends "a-" once final), and text that cannot begin one is sent at
    once. Catches a stream that sends "Spell-e" before the last "-" arrives (the stop string found after its start
    went out: the reply then ends "Spell-e", streamed or joined), and one that holds back text forever.
    """
    pieces, stopped = stream("Spell-e-e-e-e-e", ["-e-"], piece)
    assert "".join(pieces) == "Spell" and stopped, pieces
    pieces, stopped = stream("ab-", ["-e-", "zz"], piece)
    assert "".join(pieces) == "ab-" and not stopped
    reply = Reply(CharTok(), ["-e-"])
    assert reply.add([ord("x"), ord("y")]) == ("xy", False) and reply.add([ord("-")]) == ("", False)
    assert reply.add([ord("q")]) == ("-q", False)


class WordTok:
    """render_for_completion: one token per character of the messages' text, plus 2 per message."""

    def render_for_completion(self, conversation):
        return [1] * sum(len(m["content"]) + 2 for m in conversation["messages"])


def test_max_tokens_absent_fills_the_context():
    """
    A chat request without max_tokens may reply up to the end of the context (OpenAI's meaning): 256 - prompt, or
    the server's --max_tokens when that is smaller; an explicit max_tokens that cannot fit, or a prompt that leaves
    no room, is a 400 with code context_length_exceeded (the chat page drops old turns on it). Catches a default of
    a fixed 256 new tokens, which no prompt fits on a 256-token model (every page message failed).
    """
    body = {"messages": [{"role": "user", "content": "x" * 12}]}  # 14 prompt tokens
    gen, stream_, usage = chat_request(body, WordTok(), 256, 64, 0)
    assert isinstance(gen, GenerationRequest) and gen.max_tokens == 242 and gen.tool and not stream_ and not usage
    assert chat_request(body, WordTok(), 256, 64, 100)[0].max_tokens == 100
    assert chat_request(dict(body, max_tokens=242), WordTok(), 256, 64, 100)[0].max_tokens == 242
    for extra, param in (({"max_tokens": 243}, "max_tokens"), ({"messages": [{"role": "user", "content": "x" * 254}]},
                                                                 "messages")):
        with pytest.raises(APIError) as e:
            chat_request(dict(body, **extra), WordTok(), 256, 64, 0)
        assert e.value.status == 400 and e.value.param == param and e.value.code == "context_length_exceeded"
    assert new_tokens({"max_tokens": None}, 10, 20, 0) == 10
    with pytest.raises(APIError):
        new_tokens({"max_tokens": 0}, 10, 20, 0)
