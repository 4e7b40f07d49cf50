"""
The conversation schema, on the ground floor of the package: what a chat conversation is, for every task, loader,
renderer and grader. A conversation is {"messages": [...], "task": name, ...}: an optional system message first,
then user and assistant messages alternating from the user. User and system content is a str; assistant content is
a str or a list of parts {"type": "text" | "python" | "python_output", "text": str} (a calculator call, then its
output). Tasks (nanotrain.tasks) add their references ("answer", "letters", "keywords", "test", ...).
"""


CHAT_PART_TYPES = ("text", "python", "python_output")


def messages_list(conversation):
    """conversation["messages"] (a list); ValueError when `conversation` is not a dict holding such a list."""
    if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
        raise ValueError('expected a conversation {"messages": [...]} with a list of messages')
    return conversation["messages"]


def chat_messages(conversation):
    """
    The (role, content) turns of a conversation as the chat format renders them: a leading system message folded into
    the first user message (system text + "\n\n" + user text), then user and assistant alternating, starting with
    the user. Checks the structure only (empty text is allowed here; validate_conversation is stricter).
    Raises ValueError with a one-line reason: not a dict with a "messages" list, no messages, a message that is not
    {"role", "content"}, an unknown role, a system message that is not first or not followed by a user message,
    roles out of order, user/system content that is not a str, or assistant content that is neither a str nor a list
    of parts {"type": "text"|"python"|"python_output", "text": str}.
    """
    messages = messages_list(conversation)
    if not messages:
        raise ValueError("the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be an object with \"role\" and \"content\"")
        role, content = m["role"], m["content"]
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"message {i} has role {role!r}; expected 'system', 'user' or 'assistant'")
        if role == "system" and i != 0:
            raise ValueError(f"message {i} is a system message; only the first message may be one")
        if role in ("system", "user") and not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
        if role == "assistant" and not isinstance(content, str):
            if not isinstance(content, list):
                raise ValueError(f"message {i} (assistant): content must be a string or a list of parts, "
                                 f"got {type(content).__name__}")
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") in CHAT_PART_TYPES
                        and isinstance(part.get("text"), str)):
                    raise ValueError(f"message {i} (assistant) part {j}: expected {{\"type\": one of "
                                     f"{'/'.join(CHAT_PART_TYPES)}, \"text\": string}}")
        out.append((role, content))
    if out[0][0] == "system":
        if len(out) < 2 or out[1][0] != "user":
            raise ValueError("the system message must be followed by a user message")
        out = [("user", out[0][1] + "\n\n" + out[1][1])] + out[2:]
    for i, (role, _) in enumerate(out):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            n = i + (len(messages) - len(out))  # index in the original messages
            raise ValueError(f"message {n} has role {role!r} but {expected!r} was expected "
                             f"(user and assistant must alternate, starting with the user)")
    return out


def validate_conversation(obj):
    """
    None if `obj` is a valid training conversation, else a short description of what is wrong: not an object with a
    "messages" list, malformed or misordered messages (see nanotrain.tokenizer.chat_messages: an optional system
    message first, then user and assistant alternating from the user), empty content (a blank string, an empty list
    of parts or a blank text/python part), or a last message that is not the assistant's (nothing to train on).
    """
    if not isinstance(obj, dict) or "messages" not in obj:
        return 'expected a JSON object with a "messages" list'
    try:
        chat_messages(obj)
    except ValueError as e:
        return str(e)
    for i, m in enumerate(obj["messages"]):
        c = m["content"]
        if isinstance(c, str) and not c.strip():
            return f"message {i} ({m['role']}) has empty content"
        if isinstance(c, list):
            if not c:
                return f"message {i} (assistant) has an empty list of parts"
            for j, p in enumerate(c):
                if p["type"] != "python_output" and not p["text"].strip():
                    return f"message {i} (assistant) part {j} ({p['type']}) is empty"
    if obj["messages"][-1]["role"] != "assistant":
        return "the last message must be the assistant's (a training conversation ends with a reply)"
    return None


def text_of(content):
    """The text of a message's content: the str itself, or the concatenated "text" parts of a list of parts (the
    calculator's python and python_output parts left out)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def user(text):
    """A user message {"role": "user", "content": text}."""
    return {"role": "user", "content": text}


def assistant(content):
    """An assistant message; `content` is a str or a list of parts."""
    return {"role": "assistant", "content": content}


def text_part(text):
    """An assistant part of plain text."""
    return {"type": "text", "text": text}


def python_part(code):
    """An assistant part the engine hands to the calculator tool (nanotrain.calculator)."""
    return {"type": "python", "text": code}


def output_part(text):
    """The tool's output after a python part (forced by the engine at test time, never trained)."""
    return {"type": "python_output", "text": text}
