"""
AI2 ARC (Clark et al. 2018; the Hugging Face data set allenai/ai2_arc), multiple choice with 3-5 choices, rendered as
nanochat renders it (tasks/arc.py): the user message is render_mc(question, letters, choices), the reference reply the
gold letter. A row labelled "1".."5" (a few rows on the hub) gets the letters A..E (nanochat keeps the digits).
  arc_easy, arc_challenge  the benchmarks: test 2,376 / 1,172 rows (also train and validation splits)
  arc                      the training source: ARC-Easy + ARC-Challenge train (val: their validation splits)
Rows in nanochat's order per hub split (numpy.random.default_rng(42).permutation, as datasets' shuffle(seed=42)).
"""

from nanotrain.tasks.common import MultipleChoice, load_hub_rows, load_test_set, mc_conversation, render_rows

REPO = "allenai/ai2_arc"
HUB_SPLIT = {"train": "train", "val": "validation"}


class ARC(MultipleChoice):
    """ARC over the hub configs `configs` (see the module docstring); categorical, chance 0.25 (nanochat's).
    load(split, source): "test" (benchmarks only: source "auto", "hub", "pinned" or a folder) or "train"/"val" (source
    "hub" or a folder); returns (conversations, skipped)."""

    def __init__(self, name, configs):
        self.name, self.configs = name, configs
        self.splits = ("test", "train", "val") if len(configs) == 1 else ("train", "val")
        self.hub_test = (REPO, configs[0], "test")

    def to_conversation(self, row):
        """One ARC row (hub columns: question, choices {text, label}, answerKey) as a multiple-choice conversation;
        labels "1".."5" become "A".."E". Raises ValueError for a row that cannot be rendered (what is wrong)."""
        labels, texts = list(row["choices"]["label"]), list(row["choices"]["text"])
        key = row["answerKey"]
        if all(lab.isdigit() for lab in labels):
            to_letter = {lab: "ABCDE"[int(lab) - 1] for lab in labels if 1 <= int(lab) <= 5}
            if len(to_letter) != len(labels):
                raise ValueError(f"labels {labels} are not 1..5")
            labels, key = [to_letter[lab] for lab in labels], to_letter.get(key, key)
        letters = all(len(lab) == 1 and lab.isalpha() and lab.isupper() for lab in labels)
        if not letters or len(set(labels)) != len(labels):
            raise ValueError(f"labels {labels} are neither letters nor 1..5")
        if key not in labels:
            raise ValueError(f"answerKey {key!r} is not one of the labels {labels}")
        return mc_conversation(row["question"], texts, labels.index(key), labels, self.name, id=row.get("id"))

    def load(self, split, source=None, seed=0):
        self.check_split(split)
        if split == "test":
            return load_test_set(self, source or "auto")
        out, skipped = [], []
        for config in self.configs:
            rows = load_hub_rows(REPO, config, HUB_SPLIT[split], source or "hub")
            convs, bad = render_rows(self.to_conversation, rows, f"{self.name} ({REPO} {config} {HUB_SPLIT[split]})")
            out += convs
            skipped += bad
        return out, skipped
