"""
SmolTalk (HuggingFaceTB/smol-smoltalk, nanochat's general chat data for mid-training and SFT): train split, val its
test split, from the hub or a local copy of its files (data/<split>-*.parquet), in nanochat's order. Every row is
checked with nanotrain.conversation.validate_conversation; a bad row is left out and counted.
"""

from nanotrain.conversation import validate_conversation
from nanotrain.tasks.common import Task, load_hub_rows, render_rows

REPO = "HuggingFaceTB/smol-smoltalk"
HUB_SPLIT = {"train": "train", "val": "test"}


class SmolTalk(Task):
    """SmolTalk (see the module docstring); graded on the last line (grade_last_line)."""
    name = "smoltalk"

    def to_conversation(self, row):
        """One SmolTalk row ({"messages": [...]}) as a conversation {"messages", "task": "smoltalk"} with only role and
        content kept. Raises ValueError (what is wrong) for a row that is not a valid training conversation."""
        problem = validate_conversation({"messages": row["messages"]})
        if problem is not None:
            raise ValueError(problem)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]], "task": "smoltalk"}

    def load(self, split, source=None, seed=0):
        self.check_split(split)
        rows = load_hub_rows(REPO, "data", HUB_SPLIT[split], source or "hub")
        return render_rows(self.to_conversation, rows, f"smoltalk ({REPO} {HUB_SPLIT[split]})")
