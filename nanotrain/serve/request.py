"""
A generation request, checked once where it arrives and then passed whole: GenerationRequest (the record the engines
take: nanotrain.serve.batch_engine, nanotrain.serve.engine_process), chat_request (an OpenAI chat completion body into
one, the checks of scripts/chat_serve.py's /v1/chat/completions), sampling (the sampling fields any route shares) and
APIError (an OpenAI error object with its HTTP status).
"""

from dataclasses import dataclass, field

from nanotrain.errors import UserError


@dataclass
class GenerationRequest:
    """
    What one generation asks for. prompt: the token ids (list[int], non-empty); max_tokens: new tokens at most (>= 1);
    temperature: 0 is greedy, else softmax(logits / temperature) (nanotrain.engine.sample_next: below MIN_TEMPERATURE
    greedy too); top_k: sample among the k most likely tokens, None every token; seed: the request's own
    torch.Generator's; stop: strings that end the reply's text before them (cut by the server's
    nanotrain.serve.reply.Reply, the engine decodes on until it is told); ignore_eos: decode past <|assistant_end|> and
    <|bos|> up to max_tokens (a benchmark's fixed lengths, as vLLM's extension); tool: run the calculator in the reply
    (nanotrain.engine.ToolState).
    """
    prompt: list
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 42
    stop: list = field(default_factory=list)
    ignore_eos: bool = False
    tool: bool = False

    def check(self, context_len):
        """Raises UserError for an empty prompt, max_tokens < 1, a temperature that is not >= 0 (NaN included) or a
        prompt + max_tokens over context_len (int)."""
        if not self.prompt or not self.max_tokens >= 1 or not self.temperature >= 0:
            raise UserError("submit: expected a non-empty prompt, max_tokens >= 1 and temperature >= 0")
        if len(self.prompt) + self.max_tokens > context_len:
            raise UserError(f"submit: prompt ({len(self.prompt)} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                            f"context of {context_len} tokens")


class APIError(Exception):
    """An OpenAI error object with its HTTP status: status, message, param (the field, or None), type, code (e.g.
    "context_length_exceeded", OpenAI's code for a prompt that leaves no room, which the chat page acts on)."""

    def __init__(self, status, message, param=None, type_="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def sampling(body):
    """(temperature, top_k or None, seed) of a request dict, checked. Raises APIError(400) naming the field."""
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise APIError(400, "temperature: expected a number in [0, 2]", "temperature")
    top_k = body.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise APIError(400, "top_k: expected an integer >= 0 (0: every token)", "top_k")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
        raise APIError(400, "seed: expected an integer in [0, 2**63)", "seed")
    return float(temperature), top_k or None, 42 if seed is None else seed


def new_tokens(body, prompt_len, context_len, default):
    """
    The max_tokens of a request with a prompt of prompt_len tokens: the body's max_completion_tokens or max_tokens,
    which must fit the context (prompt + it <= context_len); absent (or null), up to the end of the context (OpenAI's
    meaning), at most `default` when that is > 0 (the server's --max_tokens). Raises APIError(400): a bad value, or
    one that cannot fit, or a prompt that leaves no room (code "context_length_exceeded" for both).
    """
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    room = context_len - prompt_len
    if n is not None and (not is_int(n) or n < 1):
        raise APIError(400, "max_tokens: expected an integer >= 1", "max_tokens")
    if room < 1 or (n is not None and n > room):
        asked = f" + max_tokens ({n})" if n is not None else ""
        raise APIError(400, f"max_tokens: the prompt ({prompt_len} tokens){asked} leaves no room in the model's "
                            f"context of {context_len} tokens", "messages" if n is None else "max_tokens",
                       code="context_length_exceeded")
    return n if n is not None else (min(room, default) if default > 0 else room)


def chat_request(body, tokenizer, context_len, max_messages, default_max_tokens):
    """
    The chat completion request `body` (a dict from JSON) checked field by field, once: returns (GenerationRequest
    with tool on, stream, include_usage: stream_options.include_usage, a last chunk with the usage before [DONE]).
    messages (system, user, assistant; at most max_messages; the last the user's) are rendered for completion by
    `tokenizer`; max_tokens as new_tokens() says with default_max_tokens; ignore_eos (an extension) decodes past the
    stop tokens. Raises APIError(400) naming the first bad field.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: expected a non-empty list of {role, content}", "messages")
    if len(messages) > max_messages:
        raise APIError(400, f"messages: at most {max_messages} messages, got {len(messages)}", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role: expected system, user or assistant", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: only text here
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content: expected a string", f"messages[{i}].content")
        turns.append({"role": m["role"], "content": content})
    if turns[-1]["role"] != "user":
        raise APIError(400, "messages: the last message must be the user's", "messages")
    try:
        ids = tokenizer.render_for_completion({"messages": turns})
    except (ValueError, UserError) as e:
        raise APIError(400, f"messages: {e}", "messages") from None
    n = new_tokens(body, len(ids), context_len, default_max_tokens)
    temperature, top_k, seed = sampling(body)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop: expected a string or a list of at most 4 non-empty strings", "stop")
    flags = {}
    for name in ("stream", "ignore_eos"):
        flags[name] = body.get(name, False)
        if not isinstance(flags[name], bool):
            raise APIError(400, f"{name}: expected true or false", name)
    options = body.get("stream_options") or {}
    usage = options.get("include_usage", False) if isinstance(options, dict) else None
    if not isinstance(usage, bool):
        raise APIError(400, "stream_options: expected {\"include_usage\": true or false}", "stream_options")
    gen = GenerationRequest(ids, n, temperature, top_k, seed, stop, flags["ignore_eos"], tool=True)
    return gen, flags["stream"], usage
