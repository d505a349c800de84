"""`lmforge chat`: on the model's own chat template, stopping at any of its stop tokens, one KV
cache across turns, /reset and /exit, --format json; typed into a real pseudo-terminal. Every reply
is checked against transformers' greedy generate on the conversation apply_chat_template renders
(fp32 on both sides: the logits agree to 1e-5, tests/test_interop.py, far from any argmax tie of
these few steps). The model is tests/test_interop.py's tiny instruct Llama; nothing is downloaded."""

import json
import os
import pty
import select
import subprocess
import sys
import termios
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lmforge.data.special_tokens import special_tokens  # noqa: E402
from lmforge.generate.chat import ChatSession  # noqa: E402
from lmforge.generate.load import load_for_sampling  # noqa: E402
from test_interop import hf_model, tokenizer  # noqa: E402,F401  (tokenizer: the fixture)

MAX_NEW = 8


@pytest.fixture
def instruct(tokenizer, tmp_path):
    hf_model("llama", tmp_path / "hf", tokenizer, chat=True)
    return tmp_path / "hf"


def transformers_reply(folder, messages) -> str:
    """What transformers' greedy generate answers to `messages` under the folder's template."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_session_streams_and_runs_only_the_new_turn(instruct):
    loaded, special = load_for_sampling(instruct)
    model, tok = loaded.model, loaded.tokenizer
    session = ChatSession(model, tok, special, MAX_NEW, temperature=0.0)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    pieces = []
    first = session.reply("def fib", on_text=pieces.append)
    assert "".join(pieces) == first and len(pieces) > 1  # streamed a piece per token
    assert first == transformers_reply(instruct, session.messages[:1])
    first_prompt, history, seen[:] = session.prompt, list(session.tokens), []
    second = session.reply("return n")
    target = session.prompt
    # only what follows the shared prefix ran (the first prompt at least was reused from the cache)
    assert len(os.path.commonprefix([history, target])) >= len(first_prompt)
    assert len(target) - len(os.path.commonprefix([history, target])) == seen[0] < len(target)  # tokens fed
    assert second == transformers_reply(instruct, session.messages[:3])
    session.reset()
    seen[:] = []
    assert session.reply("def fib") == first and seen[0] == len(first_prompt)


class Terminal:
    """`lmforge chat ...` on a pseudo-terminal: lines typed, output read as it comes (no echo)."""

    def __init__(self, *args, cwd):
        self.master, slave = pty.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] &= ~termios.ECHO
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.proc = subprocess.Popen([sys.executable, "-m", "lmforge", "chat", *args], cwd=cwd, stdin=slave,
                                     stdout=slave, stderr=slave, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.close(slave)

    def read_until(self, end: str, timeout: float = 120) -> str:
        out, deadline = b"", time.monotonic() + timeout
        while not out.replace(b"\r\n", b"\n").decode(errors="replace").endswith(end):
            if time.monotonic() > deadline or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                raise AssertionError(f"no {end!r} after {out!r}")
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    out += os.read(self.master, 4096)
                except OSError:  # the process closed the terminal
                    continue
        return out.replace(b"\r\n", b"\n").decode()

    def say(self, line: str) -> str:
        """The reply to `line`: what is printed before the next prompt."""
        os.write(self.master, (line + "\n").encode())
        return self.read_until("\n> ")[:-len("\n> ")]

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


def test_chat_in_a_terminal_answers_as_transformers(instruct, tmp_path):
    term = Terminal("hf", "--temperature", "0", "--max-new-tokens", str(MAX_NEW), "--device", "cpu", cwd=tmp_path)
    try:
        assert "its chat template" in term.read_until("> ")
        first = term.say("def fib")
        assert first == transformers_reply(instruct, [{"role": "user", "content": "def fib"}])
        second = term.say("return n")
        assert second == transformers_reply(instruct, [{"role": "user", "content": "def fib"},
                                                       {"role": "assistant", "content": first},
                                                       {"role": "user", "content": "return n"}])
        assert term.say("/reset") == "(new conversation)"
        assert term.say("def fib") == first
        os.write(term.master, b"/exit\n")
    finally:
        status = term.close()
    assert status == 0


def test_chat_format_json_answers_match_the_schema(instruct, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    term = Terminal("hf", "--format", "json", "--schema", "schema.json", "--max-new-tokens", "40", "--device", "cpu",
                    cwd=tmp_path)
    try:
        term.read_until("> ")
        for question in ("def fib", "return n"):
            assert json.loads(term.say(question)) in ({"ok": True}, {"ok": False})
        os.write(term.master, b"\x04")  # Ctrl-D ends it too
    finally:
        status = term.close()
    assert status == 0


def test_a_model_without_a_template_is_asked_as_lmforge_fine_tunes_it(tokenizer):
    """lmforge's own model: the plain template's ids, as data/sft.py encodes the same turns."""
    from lmforge.data.sft import encode_example, example_parts
    from lmforge.data.special_tokens import special_tokens
    from lmforge.model.transformer import Transformer
    from test_interop import tiny_model_config

    special = special_tokens(tokenizer, "<|endoftext|>")
    session = ChatSession(Transformer(tiny_model_config("llama")).eval(), tokenizer, special, 4, temperature=0.0)
    assert special.chat_template is None and special.stop_ids == (special.end_id,)
    session.reply("def fib")
    messages = [{"role": "user", "content": "def fib"}, {"role": "assistant", "content": "x"}]
    ids, _ = encode_example(tokenizer, example_parts({"messages": messages}, "r"), special=special)
    assert session.prompt == ids[:len(session.prompt)]
    assert tokenizer.decode(session.prompt) == "<|user|>\ndef fib\n<|assistant|>\n"


def test_chat_samples_with_the_model_defaults_unless_told(instruct):
    from lmforge.generate.chat import sampling_options

    loaded, special = load_for_sampling(instruct)
    assert sampling_options(special, None, None, None) == {"temperature": 0.6, "top_k": None, "top_p": 0.9}
    assert sampling_options(special, 0.0, 5, None) == {"temperature": 0.0, "top_k": 5, "top_p": 0.9}
    # transformers' spellings of "unset" in generation_config.json: top_k 0 (no top-k) and null
    files = {**special.files, "generation_config.json": b'{"top_k": 0, "temperature": null, "top_p": 1}'}
    unset = special_tokens(loaded.tokenizer, special.end, files)
    assert sampling_options(unset, None, None, None) == {"temperature": 0.8, "top_k": None, "top_p": 1}


def test_a_conversation_past_the_models_positions_is_said_once(tokenizer):
    """generate() keeps the latest positions when a conversation outgrows the model (32 here): chat
    says so once, and again after /reset only when it happens again."""
    import io

    from lmforge.data.special_tokens import special_tokens
    from lmforge.generate.chat import run_chat
    from lmforge.model.transformer import Transformer
    from test_interop import tiny_model_config

    special = special_tokens(tokenizer, "<|endoftext|>")
    session = ChatSession(Transformer(tiny_model_config("llama")).eval(), tokenizer, special, 4, temperature=0.0)
    lines, out = iter(["hi", "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)", "and", "/reset", "hi",
                       "/exit"]), io.StringIO()
    assert run_chat(session, "tiny", out=out, read=lambda prompt: next(lines)) == 0
    said = out.getvalue().split("(new conversation)")
    assert [part.count("past the model's 32 positions") for part in said] == [1, 0]
