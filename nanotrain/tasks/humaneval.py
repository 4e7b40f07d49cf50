"""
HumanEval (Chen et al. 2021; the Hugging Face data set openai/openai_humaneval): 164 Python problems, test split only,
rendered and graded as nanochat does (tasks/humaneval.py): the prompt (signature and docstring) is the user message,
prompt + canonical solution the reference reply; a reply is graded by running the prompt's imports, the reply's code,
the problem's tests and check(entry_point) in nanotrain.sandbox.execution's sandbox, HUMANEVAL_TIMEOUT_S and
HUMANEVAL_MEMORY per program.
"""

import re

from nanotrain.sandbox.humaneval_check import check_all
from nanotrain.tasks.common import Task, load_test_set, resolve_source

HUMANEVAL_TIMEOUT_S = 5.0  # wall-clock limit per HumanEval program (nanochat's)
HUMANEVAL_MEMORY = 256 * 2**20  # bytes of address space per HumanEval program (nanochat's)
SANDBOX_WORKERS = 4  # HumanEval programs run at once (each its own subprocess)


def humaneval_conversation(row):
    """One HumanEval row (task_id, prompt, canonical_solution, test, entry_point) as a conversation: the prompt as the
    user message, prompt + "\n" + canonical solution as the reference reply (nanochat's rendering), with
    "entry_point", "test" and "id" kept for grading (humaneval_program)."""
    for k in ("prompt", "canonical_solution", "test", "entry_point"):
        if not isinstance(row.get(k), str) or not row[k].strip():
            raise ValueError(f"no {k}")
    return {"messages": [{"role": "user", "content": row["prompt"]},
                         {"role": "assistant", "content": f"{row['prompt']}\n{row['canonical_solution']}"}],
            "task": "humaneval", "id": row.get("task_id"), "entry_point": row["entry_point"], "test": row["test"]}


def extract_imports(prompt):
    """The import lines at the top of a HumanEval prompt (blank and comment lines skipped, up to the first other
    line), joined by newlines."""
    out = []
    for line in prompt.split("\n"):
        s = line.strip()
        if s.startswith(("import ", "from ")):
            out.append(s)
        elif s and not s.startswith("#"):
            break
    return "\n".join(out)


def extract_program(completion):
    """The first ```python (or ```) fenced block of a reply, stripped; the whole reply stripped if it has none."""
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", completion, re.DOTALL)
    return blocks[0].strip() if blocks else completion.strip()


def humaneval_program(conversation, completion):
    """The program that grades a HumanEval reply (nanochat's): the prompt's imports, the reply's code
    (extract_program), the problem's test code and check(entry_point), separated by blank lines."""
    return (f"{extract_imports(conversation['messages'][0]['content'])}\n\n{extract_program(completion)}\n\n"
            f"{conversation['test']}\ncheck({conversation['entry_point']})\n")


def grade_humaneval(pairs, timeout_s=HUMANEVAL_TIMEOUT_S, memory_bytes=HUMANEVAL_MEMORY, workers=SANDBOX_WORKERS):
    """[(conversation, completion)] -> list[bool]: grade_humaneval_detail's "passed" of each."""
    return [d["passed"] for d in grade_humaneval_detail(pairs, timeout_s, memory_bytes, workers)]


def grade_humaneval_detail(pairs, timeout_s=HUMANEVAL_TIMEOUT_S, memory_bytes=HUMANEVAL_MEMORY, workers=SANDBOX_WORKERS):
    """
    [(conversation, completion)] -> list of {"passed", "outcome", "error"} (humaneval_check.check_humaneval):
    each reply graded by nanotrain.sandbox.humaneval_check (`workers` at a time):
    humaneval_program's text without its test (the prompt's imports and the reply's code) runs in
    nanotrain.sandbox.execution's sandbox, and the test's check(entry_point) in a trusted process that calls the reply's
    function across a pipe, so the verdict cannot be forged from inside the program. That process has the grader's
    rights only for a conversation whose "trusted_test" is True (load() sets it for the verified pinned set only);
    any other test runs sandboxed too. Raises UserError when there is
    no isolation for model-written code and --unsafe_code was not given (nanotrain.sandbox.execution.require_isolation).
    """
    jobs = [{"program": f"{extract_imports(c['messages'][0]['content'])}\n\n{extract_program(r)}\n\n",
             "prompt": c["messages"][0]["content"], "test": c["test"], "entry_point": c["entry_point"],
             "trusted_test": c.get("trusted_test") is True}
            for c, r in pairs]
    return check_all(jobs, timeout_s=timeout_s, memory_bytes=memory_bytes, workers=workers)


class HumanEval(Task):
    """HumanEval (see the module docstring): split "test" only, from "auto", "hub", "pinned" or a folder; graded in
    the sandbox (grade_humaneval), many programs at once with grade_batch."""
    name = "humaneval"
    splits = ("test",)
    hub_test = ("openai/openai_humaneval", "openai_humaneval", "test")

    to_conversation = staticmethod(humaneval_conversation)

    def load(self, split, source=None, seed=0):
        self.check_split(split)
        source = resolve_source(source or "auto")
        convs, skipped = load_test_set(self, source)
        if source == "pinned":  # sha256-verified by nanotrain.tasks.benchmarks: its tests may run with the grader's rights
            for c in convs:
                c["trusted_test"] = True
        return convs, skipped

    def grade_detail(self, conversations, replies):
        """grade_humaneval_detail of each (conversation, reply): {"passed", "outcome", "error"}."""
        return grade_humaneval_detail(list(zip(conversations, replies)))

    def grade(self, conversation, reply):
        return grade_humaneval([(conversation, reply)])[0]

    def grade_batch(self, conversations, replies):
        return grade_humaneval(list(zip(conversations, replies)))
