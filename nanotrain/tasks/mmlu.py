"""
MMLU (Hendrycks et al. 2021; the Hugging Face data set cais/mmlu, config "all"), multiple choice with 4 choices
(letters A-D), rendered as nanochat renders it (tasks/mmlu.py):
  mmlu      the benchmark: test 14,042 rows, 57 subjects, in nanochat's order
  mmlu_aux  the training source: auxiliary_train (~100K rows; val: the validation split)
"""

from nanotrain.tasks.common import MultipleChoice, load_hub_rows, load_test_set, mc_conversation, render_rows

REPO = "cais/mmlu"


class MMLU(MultipleChoice):
    """MMLU with `hub_splits` {our split: the hub's split} (see the module docstring); categorical, chance 0.25.
    load(split, source): "test" from "auto", "hub", "pinned" or a folder; "train"/"val" from "hub" or a folder."""
    hub_test = (REPO, "all", "test")

    def __init__(self, name, hub_splits):
        self.name, self.hub_splits = name, hub_splits
        self.splits = tuple(hub_splits)

    def to_conversation(self, row):
        """One MMLU row (hub columns: question, subject, choices (4), answer 0-3) as a multiple-choice conversation with
        letters A-D and its "subject". Raises ValueError for a row that cannot be rendered."""
        if len(row["choices"]) != 4:
            raise ValueError(f"{len(row['choices'])} choices, MMLU has 4")
        return mc_conversation(row["question"], list(row["choices"]), int(row["answer"]), "ABCD", self.name,
                               subject=row.get("subject"))

    def load(self, split, source=None, seed=0):
        self.check_split(split)
        if split == "test":
            return load_test_set(self, source or "auto")
        rows = load_hub_rows(REPO, "all", self.hub_splits[split], source or "hub")
        return render_rows(self.to_conversation, rows, f"{self.name} ({REPO} all {self.hub_splits[split]})")
