import json

import jsonschema
import pytest
import torch

from lmforge.cli import main
from lmforge.config import make_config
from lmforge.data.corpus import END_OF_TEXT, train_tokenizer
from lmforge.model.transformer import Transformer
from lmforge.structured.constrain import JsonMode
from lmforge.structured.parse import ParseError, check_schema, parse_answer
from tests.conftest import tiny_overrides
from tests.test_cli import lmforge

# Bounded values: every answer fits in about 40 tokens, so a budget of 200 always completes.
ANSWER_SCHEMA = {"type": "object",
                 "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                                "reasoning": {"type": "string", "maxLength": 12}},
                 "required": ["reasoning", "answer"], "additionalProperties": False}


@pytest.mark.parametrize("fmt, text, value", [
    ("json", '{"answer": 5, "ok": true}', {"answer": 5, "ok": True}),
    ("json", 'Sure, here it is:\n```json\n{"answer": [1, 2]}\n```\nAnything else?', {"answer": [1, 2]}),
    ("json", 'The answer is {"answer": "x{y}"} as asked.', {"answer": "x{y}"}),
    ("json", "  42\n", 42),
    ("json", '{"code": "```py"}', {"code": "```py"}),  # backticks inside a string are no fence
    ("yaml", "answer: 5\nreasoning: two plus three\n", {"answer": 5, "reasoning": "two plus three"}),
    ("yaml", "Here is the answer:\n\nanswer: 5\nitems:\n  - a\n  - b\n", {"answer": 5, "items": ["a", "b"]}),
    ("yaml", "```yaml\n- 1\n- 2\n```", [1, 2]),
    ("xml", "<answer>5</answer>", "5"),
    ("xml", 'Result: <r><answer>5</answer><i>a</i><i>b</i><n k="v">t</n></r> done.',
     {"answer": "5", "i": ["a", "b"], "n": {"@k": "v", "#text": "t"}}),
    ("xml", "```xml\n<?xml version='1.0'?>\n<r><a>1</a></r>\n```", {"a": "1"}),
])
def test_parsers_read_valid_and_wrapped_answers(fmt, text, value):
    assert parse_answer(text, fmt) == value


@pytest.mark.parametrize("fmt, text, why", [
    ("json", '{"answer": 5,}', "invalid JSON at line 1 column 14: Expecting property name enclosed in double quotes"),
    ("json", "{'answer': 5}", "invalid JSON at line 1 column 2: Expecting property name enclosed in double quotes"),
    ("json", '{"a": 1}}', "unexpected text after the JSON value at line 1 column 9: '}'"),
    ("json", '{"a": 1, "a": 2}', "duplicate key 'a'"),
    ("json", '{"a": NaN}', "NaN is not JSON"),
    ("json", "the answer is five", "no JSON object or array in the answer"),
    ("json", '```json\n{"a": 1}\n', "a code fence is opened but never closed"),
    ("json", '{"answer": "12', "invalid JSON at line 1 column 12: Unterminated string starting at"),
    ("yaml", "a: 1\na: 2\n", "duplicate key 'a'"),
    ("yaml", "the answer is five", "no YAML mapping or list in the answer"),
    ("yaml", "a: [1, 2\n", "invalid YAML at line 2 column 1: expected ',' or ']', but got '<stream end>'"),
    ("yaml", "```\njust words\n```", "the YAML answer is a str, not a mapping or list"),
    ("xml", "<r><a>1</r>", "invalid XML at line 1 column 10: mismatched tag"),
    ("xml", "<r>text<a>1</a></r>", "<r> mixes text and elements"),
    ("xml", "no markup at all", "no XML element in the answer"),
    ("xml", '<!DOCTYPE r [<!ENTITY e "x">]><r>&e;</r>', "XML with a DTD (<!DOCTYPE or <!ENTITY) is not accepted"),
])
def test_parsers_say_why_an_answer_does_not_parse(fmt, text, why):
    with pytest.raises(ParseError) as err:
        parse_answer(text, fmt)
    assert str(err.value).startswith(why)


@pytest.mark.parametrize("value, why", [
    ({"reasoning": "r"}, "schema violation at the top level: 'answer' is a required property"),
    ({"reasoning": "r", "answer": "5"}, "schema violation at ['answer']: '5' is not of type 'integer'"),
    ({"reasoning": "r", "answer": 5, "extra": 1}, "schema violation at the top level: Additional properties are "
                                                  "not allowed ('extra' was unexpected)"),
])
def test_schema_violations_are_named(value, why):
    check_schema({"reasoning": "r", "answer": 5}, ANSWER_SCHEMA)
    with pytest.raises(ParseError, match=None) as err:
        check_schema(value, ANSWER_SCHEMA)
    assert str(err.value) == why


@pytest.fixture(scope="module")
def tiny():
    """An untrained tiny model (its outputs are near-random) and a real byte-level BPE tokenizer."""
    texts = [json.dumps({"answer": i, "reasoning": f"step {i} of {i % 7}", "xs": list(range(i % 4))})
             + f" and some prose number {i}." for i in range(400)]
    tokenizer = train_tokenizer(texts, 512)
    torch.manual_seed(0)
    model = Transformer(make_config("tiny", overrides=["model.max_seq_len=48"]).model).eval()
    return model, tokenizer, tokenizer.token_to_id(END_OF_TEXT)


@pytest.mark.parametrize("schema", [None, ANSWER_SCHEMA], ids=["any-object", "schema"])
def test_constrained_decoding_never_emits_unparsable_json(tiny, schema):
    model, tokenizer, end = tiny
    json_mode = JsonMode(tokenizer, end, schema)
    counts = {True: 0, False: 0}
    for seed in range(50):
        # 60 tokens from a window of 48 also restarts the cached context on the way
        sampling = [dict(), dict(top_k=20), dict(top_p=0.9)][seed % 3]
        budget = 60 if seed % 2 else 6  # half of them run into max_new_tokens
        out = json_mode.generate(model, tokenizer.encode("answer:").ids, budget, temperature=1.0, seed=seed,
                                 **sampling)
        counts[out.complete] += 1
        if out.complete:
            value = json.loads(out.text)
            assert isinstance(value, dict) and value == out.value
            if schema is not None:
                jsonschema.validate(value, schema)
        else:  # cut: said so, and it really is unfinished JSON
            assert len(out.tokens) == budget
            with pytest.raises(json.JSONDecodeError):
                json.loads(out.text)
    assert counts[True] >= 3 and counts[False] >= 3, counts  # both outcomes were checked


def test_the_constraint_works_the_same_with_and_without_the_kv_cache(tiny):
    model, tokenizer, end = tiny
    json_mode = JsonMode(tokenizer, end, ANSWER_SCHEMA)
    for seed in range(3):
        texts = [json_mode.generate(model, [end], 60, temperature=1.0, seed=seed, use_cache=use_cache).text
                 for use_cache in (True, False)]
        assert texts[0] == texts[1]


def test_unconstrained_answers_of_the_same_model_are_not_json(tiny):
    """The model alone does not write JSON: what the tests above see is the mask's doing."""
    from lmforge.generate.sampling import generate

    model, tokenizer, end = tiny
    texts = [tokenizer.decode(generate(model, [end], 30, temperature=1.0, seed=seed, stop_token=end))
             for seed in range(10)]
    assert not any(text.startswith("{") for text in texts)


def test_unknown_format_is_one_line_exit_2_from_the_command():
    result = lmforge("generate", "--run", "runs/none", "--format", "yaml")
    assert result.returncode == 2
    assert result.stderr == ("lmforge: error: --format yaml: constrained decoding supports json (the grammar engine "
                             "has no YAML or XML grammar)\n")


@pytest.mark.parametrize("args, message", [
    (["--format", "toml"], "--format toml: constrained decoding supports json (the grammar engine has no YAML or "
                           "XML grammar)"),
    (["--schema", "s.json"], "--schema needs --format json"),
    (["--format", "json", "--schema", "missing.json"], "schema file missing.json not found"),
    (["--format", "json", "--schema", "bad.json"], "the schema is not a valid JSON Schema at ['type']: 'objekt' is "
                                                   "not valid under any of the given schemas"),
    (["--format", "json", "--schema", "not.json"], "the schema cannot be used for constrained decoding: "
                                                   "Unimplemented keys: [\"not\"]"),
    (["--format", "json", "--schema", "broken.json"], "schema file broken.json is not JSON (Expecting value: line 1 "
                                                      "column 1 (char 0))"),
])
def test_bad_format_or_schema_is_one_line_exit_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text('{"type": "objekt"}')
    (tmp_path / "s.json").write_text('{"type": "object"}')
    (tmp_path / "broken.json").write_text("not json")
    (tmp_path / "not.json").write_text('{"not": {"type": "string"}}')
    # checked before the run is read: the run folder need not exist
    assert main(["generate", "--run", "runs/none", *args]) == 2
    assert capsys.readouterr().err == f"lmforge: error: {message}\n"


def test_generate_format_json_on_a_trained_run(tmp_path, corpus_dir, data_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(corpus_dir, data_dir, max_steps=2, eval_interval=2, checkpoint_interval=2)
    assert main(["train", "--model", "tiny", "--name", "t", "--no-progress", *overrides]) == 0
    capsys.readouterr()
    (tmp_path / "s.json").write_text(json.dumps(ANSWER_SCHEMA))
    status = main(["generate", "--run", "runs/t", "--format", "json", "--schema", "s.json", "--prompt", "x = ",
                 "--max-new-tokens", "200", "--temperature", "0.3", "--num-samples", "2"])
    assert status == 0, capsys.readouterr().err
    samples = capsys.readouterr().out.split("--- sample 2 ---\n")
    for text in (samples[0].removeprefix("--- sample 1 ---\n"), samples[1]):
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    assert main(["generate", "--run", "runs/t", "--format", "json", "--max-new-tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("lmforge: error: the answer was cut at --max-new-tokens 1 before its JSON closed: "
                            "raise --max-new-tokens\n")
