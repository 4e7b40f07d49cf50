"""
Chat with a trained model in the terminal.

    python scripts/chat_cli.py                          # interactive, the newest checkpoint of the latest stage
    python scripts/chat_cli.py -p "What is 12 + 30?"    # one answer, then exit (same as --prompt="...")
    python scripts/chat_cli.py --source=mid --run_name=cpu --temperature=0

Interactive: type a message and press enter; 'clear' starts a new conversation, 'quit', 'exit' or Ctrl-D leaves.
The latest stage is RL's if it has a checkpoint, else SFT's, else mid-training's (the recipe's best model first). A
calculator call shows as [calculator: 37 + 48 -> 85].
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import sys

import torch

from nanotrain.checkpoint import find_run_dir, load_model
from nanotrain.common import autodetect_device_type, run_script
from nanotrain.configurator import configure
from nanotrain.engine import Engine, TextStream, readable
from nanotrain.errors import UserError

for _i, _arg in enumerate(sys.argv[1:-1], 1):  # the conventional `-p "text"` -> --prompt=text
    if _arg == "-p":
        sys.argv[_i:_i + 2] = [f"--prompt={sys.argv[_i + 1]}"]
        break
_prompt_given = any(a.startswith("--prompt=") for a in sys.argv[1:])  # tells `-p ""` from no prompt at all

source = ""  # which stage's checkpoint: rl | sft | mid | base; "" is the latest stage that has one (rl, sft, mid)
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
prompt = ""  # one-shot mode: answer this message and exit (also -p "text"); not given: interactive
temperature = 0.6  # 0 is greedy
top_k = 50  # sample among the k most likely tokens; 0 means all
max_tokens = 256  # most tokens per reply
seed = 42  # sampling seed (turn t of a conversation uses seed + t)
tool = True  # run the calculator tool when the model calls it (False: the model writes the tool's output itself)
device_type = ""  # cuda | mps | cpu; "" autodetects
config = configure(globals())


def check_settings():
    """
    Raises UserError (one line naming the flag) for a prompt given but empty or whitespace-only (-p "" or
    --prompt=""). The ranges of max_tokens, temperature and top_k are configure()'s (nanotrain.configurator.RULES).
    """
    if _prompt_given and not prompt.strip():
        raise UserError(f"--prompt={prompt!r} (-p): expected a non-empty message; leave out -p to chat interactively")


def latest_stage():
    """The stage whose checkpoint chat_cli loads by default: rl, then sft, then mid, the first with a checkpoint of
    --run_name (any run when it is ""). Raises UserError when none has one."""
    for stage in ("rl", "sft", "mid"):
        if find_run_dir(stage, run_name) is not None:
            return stage
    raise UserError("no rl, sft or mid checkpoint found; train a chat model first (python scripts/chat_sft.py), or "
                    "pass --source=base")


def assistant_parts(text):
    """The decoded reply as assistant content: a list of parts (text, python, python_output) split at the tool's
    special tokens, so the next turn renders the calculator call as the model produced it."""
    parts, rest = [], text
    while rest:
        start = rest.find("<|python_start|>")
        if start < 0:
            parts.append({"type": "text", "text": rest})
            break
        if start:
            parts.append({"type": "text", "text": rest[:start]})
        code, _, rest = rest[start + len("<|python_start|>"):].partition("<|python_end|>")
        parts.append({"type": "python", "text": code})
        if rest.startswith("<|output_start|>"):
            out, _, rest = rest[len("<|output_start|>"):].partition("<|output_end|>")
            parts.append({"type": "python_output", "text": out})
    return [p for p in parts if p["text"] or p["type"] != "text"] or [{"type": "text", "text": ""}]


def main():
    check_settings()
    device = torch.device(device_type or autodetect_device_type())
    stage = source or latest_stage()
    model, tokenizer, path, _ = load_model(stage, run_name, step, device)
    print(f"checkpoint: {path}", file=sys.stderr)
    engine = Engine(model, tokenizer)

    def reply(messages, turn):
        """Streams the assistant's answer to `messages` to stdout and returns its text."""
        ids = tokenizer.render_for_completion({"messages": messages})
        out, stream = [], TextStream(tokenizer, readable)  # never half a character on the terminal
        for tok in engine.generate_stream(ids, max_tokens, temperature, top_k or None, seed + turn, tool=tool):
            out.append(tok)
            print(stream.add([tok]), end="", flush=True)
        print(stream.add([], final=True), flush=True)
        return assistant_parts(tokenizer.decode(out))

    if prompt:
        reply([{"role": "user", "content": prompt}], 0)
        return
    print("nanotrain chat: 'clear' starts over, 'quit' or Ctrl-D leaves", file=sys.stderr)
    messages = []
    while True:
        try:
            line = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line in ("quit", "exit"):
            return
        if line == "clear":
            messages = []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        print("Assistant: ", end="", flush=True)
        try:
            answer = reply(messages, len(messages) // 2)
        except UserError as e:  # the conversation outgrew the model's positions
            print(f"\n{e}; type 'clear' to start over", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer if len(answer) > 1 or answer[0]["type"] != "text"
                         else answer[0]["text"]})


if __name__ == "__main__":
    run_script(main)
